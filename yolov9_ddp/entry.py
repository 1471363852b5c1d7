"""What every kit entry point runs, `end_process(main('detect-dual', root=ROOT))`: parse the flags of the upstream
script it replaces, join the process group, train the task, and end every way out with one line and an exit status.
"""
import os
import sys
import traceback

from pathlib import Path

if int(os.environ.get('RANK', 0)) != 0:
    os.environ.setdefault('TQDM_DISABLE', '1')  # progress bars on rank 0 only; read when tqdm is first imported

from yolov9_ddp.environment import exit_if_unsupported  # noqa: E402

exit_if_unsupported(Path(sys.argv[0]).name)  # a too-old torch or no OpenCV: one line, not upstream's traceback

from yolov9_ddp import checkpoints, cli, comm, data, failures, launch, runs, shutdown  # noqa: E402
from yolov9_ddp.perf import CUBLAS_WORKSPACE  # noqa: E402
from yolov9_ddp.tasks import TASKS  # noqa: E402

EXIT_USAGE, EXIT_FAILED = 2, 1
KIT_ERRORS = (cli.UsageError, comm.LaunchError, checkpoints.CheckpointError, comm.PeerFailed, data.DataError,
              runs.RunBusy)


def report(script: str, error: BaseException, consequence=False):
    """One line per failure, from the rank that saw it (rank 0 for an error every rank sees alike); every rank
    records its line for torchrun's summary. consequence: this rank failed because another did."""
    rank = comm.launched_rank()
    where = f' [rank {rank}]' if comm.launched_world_size() > 1 else ''
    alike = (isinstance(error, comm.Unanimous) and rank != 0) or \
        (isinstance(error, comm.LaunchError) and comm.get_local_rank() != 0)  # a node's processes see it alike
    silent = alike or isinstance(error, comm.PeerFailed)  # PeerFailed: the failed rank reports, before its exit
    if not silent:
        print(f'{script}: error{where}: {error}', file=sys.stderr, flush=True)
    failures.record_for_torchrun(f'{script}{where}: {error}', consequence or isinstance(error, comm.PeerFailed))
    if silent:
        failures.wait_for_the_node_reporter()


def fail(script: str, error: Exception) -> int:
    """This rank alone failed (a bug, a killed loader worker, out of memory): a traceback where the cause is not a
    known one, then the one line; its workers end and it exits, so that torchrun restarts the job or stops the rest."""
    line, helps = failures.cause(error)
    if helps:
        traceback.print_exception(error)
    report(script, RuntimeError(line))
    failures.end_children()
    return EXIT_FAILED


def main(task_name: str, argv=None, root=None, parts=()) -> int:
    """parts: called before the run's own at every point of the loop (a test's faults, parts/)."""
    task = TASKS[task_name]
    try:
        opt = cli.parse_args(argv, root, task)
    except cli.UsageError as e:
        return outcome(task, None, e)
    failures.end_children_at_exit()
    try:
        cli.check_launch(opt)
        launch.check(opt)
        resumes = opt.resume or opt.auto_resume
        command = sys.argv[1:] if argv is None else argv  # what each worker of a --device list runs again
        if not resumes and launch.wanted(opt):  # checked once, here, before any worker starts
            cli.check_options(opt, len(comm.listed_devices(opt.device)), task)
            return launch.run(sys.argv[0], command, opt)
        if not resumes:  # a new run's options are its own already: refused before upstream's modules load (4 s)
            device = checked_device(opt, task)
        from yolov9_ddp import build  # upstream's modules
        said = []  # the resume's lines: said here, unless the run's --device list starts workers that say them
        plan = build.plan_start(opt, cli.given_flags(argv, root, task), said.append)  # a resume: the run's opt
        if resumes and launch.wanted(opt):  # the run's own --device list
            return launch.run(sys.argv[0], command, opt)
        for line in said:
            build.LOGGER.info(line)
        if resumes:
            device = checked_device(opt, task)
        comm.print_banner(device, opt.device)
        with comm.process_group(device, opt.ddp_timeout):
            try:
                build.train(task, opt, device, plan, parts)
            except Exception as e:  # reported before the group is destroyed: a destroy that hangs cannot hide it
                return outcome(task, opt, e)
    except Exception as e:  # before the process group exists, or from making it
        return outcome(task, opt, e)
    return 0


def checked_device(opt, task):
    """The run's options checked (cli.check_options) and this process's device (comm.select_device)."""
    cli.check_options(opt, comm.launched_world_size(), task)
    if opt.deterministic:  # read when cuBLAS starts: before any CUDA work (a resumed run's flag too)
        os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', CUBLAS_WORKSPACE)
    return comm.select_device(opt.device)


def outcome(task, opt, error: Exception) -> int:
    """The exit status of a run that raised error, once its one line is out (where it is this rank's to say)."""
    if isinstance(error, cli.UsageError):
        report(task.script, error)
        return EXIT_USAGE
    if isinstance(error, KIT_ERRORS):
        report(task.script, error)
        return EXIT_FAILED
    if isinstance(error, shutdown.Interrupted):
        failures.record_for_torchrun(f'{task.script} [rank {comm.launched_rank()}]: {error}')
        if comm.launched_rank() == 0:
            print(f'{task.script}: {error}', file=sys.stderr, flush=True)
        return error.exit_status
    line = failures.collective_failure(error, opt.ddp_timeout)  # a peer gone or stalled
    if line is None:  # a bug, out of memory, a dataset that raises: this rank alone
        return fail(task.script, error)
    report(task.script, RuntimeError(line), consequence=True)
    return EXIT_FAILED
