"""Slurm launch (``mgrpo launch slurm``): readable sbatch templates (``templates/``), the renderer
(`launch.slurm.render`), submission (`launch.slurm.submit`), the CLI (`launch.slurm.cli`) and what
the scripts run on the nodes (`launch.slurm.node`, `launch.slurm.torchrun`, `launch.slurm.worker`).
docs/slurm.md explains the generated scripts line by line."""
