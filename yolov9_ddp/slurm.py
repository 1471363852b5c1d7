"""What the kit knows of Slurm: whether the job it runs in was requeued, and whether the run can continue then.

A requeued job runs its script again with the same flags, and continues its run only with --auto-resume and a fixed
--name, as slurm/*.sbatch give; without them it would quietly start over in a new folder, so rank 0 says so.
"""
import os


def restart_count() -> int:
    """How often Slurm requeued the job this process runs in (0: first start, or not under Slurm)."""
    return int(os.environ.get('SLURM_RESTART_COUNT') or 0)


def warn_if_requeued_without_resume(opt, warn):
    """Call warn(line) when this is a requeued job whose command cannot continue its run (rank 0 only)."""
    if restart_count() and not (opt.resume or opt.auto_resume):
        warn(f'Slurm job {os.environ.get("SLURM_JOB_ID")} was requeued (SLURM_RESTART_COUNT={restart_count()}), but '
             f'without --auto-resume this start cannot continue the previous one and trains a new run; add '
             f'--auto-resume --name NAME to the command (the kit\'s slurm/*.sbatch scripts do)')
