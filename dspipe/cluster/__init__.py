"""Hostfiles, launches through DeepSpeed's launcher, rank environments, Slurm scripts and the preflight doctor."""
