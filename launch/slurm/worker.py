"""``torchrun ... -m launch.slurm.worker train ...``: `mgrpo` for a torchrun worker under slurm.

Ignores SIGUSR1 before anything else runs: slurm may signal the worker (directly, or through
:mod:`launch.slurm.torchrun`) while it is still importing or loading the model, and SIGUSR1's
default action would kill it. The training loop's `PreemptionHandler.install()` sets its own
handler; from then on SIGUSR1 means "checkpoint after this step and exit 0". A signal that arrives
before that is ignored (the run goes on; periodic checkpoints still happen).
"""
import signal

signal.signal(signal.SIGUSR1, signal.SIG_IGN)

import sys  # noqa: E402


def main() -> int:
    from launch.cli import main as mgrpo_main

    return mgrpo_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
