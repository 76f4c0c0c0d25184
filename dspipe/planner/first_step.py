"""The time to a run's first step, whole: what a rank spends from its process start to the end of its first step,
term by term, as engine.json and metrics.csv measure them. No torch, no deepspeed.

    launch       process start -> the model build: Python, the torch and DeepSpeed imports, the process group,
                 the data opened (GpuType.launch_s, a constant per machine class; engine.json seconds_before_build)
    build        the build's draws or checkpoint reads (dspipe.planner.startup; engine.json seconds_build)
    initialize   deepspeed.initialize and the loader (GpuType.initialize_s; engine.json ready - built)
    JIT          DeepSpeed's ops the extension cache lacks, compiled before the first step
                 (GpuType.jit_build_s per op; dspipe.cluster.opcache looks at this machine's cache)
    first step   a steady step (the plan's step time) plus the first one's own extra (GpuType.first_step_extra_s;
                 metrics.csv's step 1)

On the 'cpu' type the constants are those of the 2-core development machine, measured (CPU_STARTUP); GPU types
carry nominal ones. A profile folded from a run (`dspipe calibrate --from-run`) replaces them with that run's.
"""

from __future__ import annotations

from dataclasses import dataclass

from dspipe.spec.hardware import GpuType


@dataclass(frozen=True)
class FirstStep:
    """The time to the end of a run's first step, by term (seconds)."""

    launch_s: float
    build_s: float
    initialize_s: float
    jit_s: float
    jit_ops: tuple[str, ...]
    """The ops compiled first (empty: every op cached, or the cache not looked at)."""
    ops_checked: bool
    """Whether this machine's extension cache was looked at (planning elsewhere: the ops assumed cached)."""
    step_s: float
    """A steady step (the plan's step time)."""
    extra_s: float
    """The first step's cost beyond a steady one."""

    @property
    def seconds(self) -> float:
        return self.launch_s + self.build_s + self.initialize_s + self.jit_s + self.step_s + self.extra_s

    def _jit_text(self) -> str:
        if self.jit_ops:
            return f"JIT {_s(self.jit_s)} ({', '.join(self.jit_ops)} not cached here)"
        return "JIT 0 (" + ("ops cached here" if self.ops_checked else "ops assumed cached: cache not checked") + ")"

    def text(self) -> str:
        """'~14 s = launch 7.9 + build 0.022 + initialize 3.4 + JIT 0 (ops cached here) + first step 0.87'."""
        return (
            f"~{_s(self.seconds)} s = launch {_s(self.launch_s)} + build {_s(self.build_s)} + initialize "
            f"{_s(self.initialize_s)} + {self._jit_text()} + first step {_s(self.step_s + self.extra_s)} (a step "
            f"{_s(self.step_s)} + {_s(self.extra_s)} once)"
        )

    def to_dict(self) -> dict[str, object]:
        """The keys `plan --json` and dspipe.json's estimate carry under "first_step"."""
        return {
            "seconds": self.seconds,
            "launch_s": self.launch_s,
            "build_s": self.build_s,
            "initialize_s": self.initialize_s,
            "jit_s": self.jit_s,
            "jit_ops": list(self.jit_ops),
            "ops_checked": self.ops_checked,
            "step_s": self.step_s,
            "extra_s": self.extra_s,
        }


def _s(seconds: float) -> str:
    return f"{seconds:,.0f}" if seconds >= 100 else f"{seconds:.3g}"


def first_step(*, gpu: GpuType, build_s: float, step_s: float, missing_ops: tuple[str, ...] | None) -> FirstStep:
    """The first step of a plan on `gpu` (its start-up constants), whose build takes `build_s` and whose steady step
    `step_s`; `missing_ops`: the ops this machine's cache lacks (dspipe.cluster.opcache.missing_ops), None where the
    cache was not looked at."""
    ops = tuple(missing_ops or ())
    return FirstStep(
        launch_s=gpu.launch_s,
        build_s=build_s,
        initialize_s=gpu.initialize_s,
        jit_s=sum(gpu.jit_seconds(op) for op in ops),
        jit_ops=ops,
        ops_checked=missing_ops is not None,
        step_s=step_s,
        extra_s=gpu.first_step_extra_s,
    )
