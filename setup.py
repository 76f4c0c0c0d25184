from setuptools import find_packages, setup

setup(
    name="dspipe",
    version="0.1.0",
    description="DeepSpeed GPT pretraining with a config generator and planner",
    packages=find_packages(include=["dspipe", "dspipe.*"]),
    # Jinja templates and DeepSpeed presets are data inside the package (read with importlib.resources), so a
    # wheel / non-editable install carries them; MANIFEST.in puts the same files into an sdist.
    package_data={"dspipe": ["resources/templates/*.j2", "resources/ds_configs/*.json"]},
    include_package_data=True,
    python_requires=">=3.10",
    install_requires=[
        # lower bounds = the versions the test suite ran with
        "torch>=2.13.0",
        "deepspeed>=0.19.8",
        "transformers>=5.23.0",
        "datasets>=5.2.0",
        "tokenizers>=0.23.3",
        "jinja2>=3.1.6",
        "pyyaml>=6.0",
        "click>=8.4.0",
        "numpy>=2.4",
        "tensorboard>=2.21.0",
        "matplotlib>=3.11",
    ],
    extras_require={
        "monitor": ["wandb>=0.31", "comet_ml>=3.58"],  # --wandb-project / --comet-project (DeepSpeed's monitors)
        # the offline W&B / Comet run is tested; Megatron datasets are written and read back by megatron-core's own code
        "test": [
            "pytest>=9.0",
            "pytest-xdist>=3.8",
            "ruff==0.17.6",
            "mypy==2.4.1",
            "mkdocs==1.6.1",
            "mkdocs-material==9.8.2",
            "types-PyYAML>=6.0",
            "wandb>=0.31",
            "comet_ml>=3.58",
            "megatron-core>=0.16.1",
        ],
        # --loss-chunk on CUDA: liger-kernel's fused linear cross-entropy (Triton; its chunk_mem_const is 0.8.5's)
        "gpu": ["liger-kernel>=0.8.5"],
    },
    entry_points={"console_scripts": ["dspipe=dspipe.cli.app:main"]},
)
