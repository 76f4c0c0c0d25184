"""The rank entry point DeepSpeed's launcher starts (from any directory, the package installed or not):

    deepspeed --num_gpus N --module dspipe.runtime.entry --run runs/NAME [--resume auto|TAG|PATH | --restart]

or by torch's elastic agent (`dspipe launch --max-restarts N`), which restarts every rank when one fails; a start on
fewer ranks than planned (a node lost) continues at the smaller dp with the same global batch (dspipe.runtime.elastic).
`--hang-timeout S` ends a rank stuck in one collective for S seconds (dspipe.runtime.watchdog). The hidden
`--test-faults JSON` option is the tests' only way to inject failures (dspipe.runtime.faults).
"""

from __future__ import annotations

import argparse
import logging
import os
import time

from dspipe.errors import RunHalted, SpecError
from dspipe.log import get_logger, setup_logging
from dspipe.rundir import load_run
from dspipe.runtime.comm import exit_rank
from dspipe.runtime.elastic import NODE_RANK_ENV, earlier_refusal, elastic_restart, record_refusal, resized
from dspipe.runtime.faults import NO_FAULTS, Faults
from dspipe.runtime.loop import train
from dspipe.runtime.startup import note_ops_at_start
from dspipe.runtime.watchdog import check_hang_timeout


def _parser() -> argparse.ArgumentParser:
    """The rank entry point's command line."""
    parser = argparse.ArgumentParser(description="Train a GPT from a dspipe run directory (start it with deepspeed).")
    parser.add_argument(
        "--run",
        "--run-dir",
        dest="run",
        required=True,
        help="run directory written by 'dspipe gen-config' (--run-dir: the same, for torch's elastic "
        "agent, whose own --run-path would swallow an abbreviated --run)",
    )
    parser.add_argument(
        "--resume",
        default=None,
        metavar="auto|TAG|PATH",
        help="continue from the newest complete checkpoint (auto, the default: a run without one "
        "starts fresh), a tag under checkpoints/ or a path",
    )
    parser.add_argument(
        "--restart",
        action="store_true",
        help="start from step 0; the previous checkpoints/, metrics, engine.json and monitor/ are "
        "moved into runs/NAME/previous/<UTC timestamp>/ (nothing is deleted)",
    )
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="end the job when a rank waits this long inside one collective during the steps "
        "(0: never), so that an elastic launch restarts it",
    )
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("--test-faults", default=None, help=argparse.SUPPRESS)  # tests only: dspipe.runtime.faults
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    note_ops_at_start()  # before init_distributed, which may compile DeepSpeed's shared-memory op
    setup_logging()  # rank 0 speaks for the job (DSPIPE_LOG_ALL_RANKS=1: every rank)
    log = get_logger(__name__)
    if not os.environ.get("DSPIPE_VERBOSE"):
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    try:
        if args.restart and args.resume is not None:
            raise SpecError(
                f"--restart (start over from step 0) and --resume {args.resume} (continue a checkpoint) "
                f"contradict each other: pass one of them"
            )
        check_hang_timeout(args.hang_timeout)
        attempt = elastic_restart(os.environ)
        if attempt is not None and (refused := earlier_refusal(args.run, env=os.environ)) is not None:
            _let_rank0_speak_first()
            log.error(f"dspipe: error: {refused} (as at an earlier start of this job: not built again)")
            return 2
        node = os.environ.get(NODE_RANK_ENV, "")
        faults = (
            Faults.from_json(args.test_faults, attempt=attempt or 0, node=int(node) if node.isdigit() else None)
            if args.test_faults is not None
            else NO_FAULTS
        )
        run, change = load_run(args.run), None
        if attempt is not None:  # torch's elastic agent: this start may have fewer ranks than the plan
            run, change = resized(
                run, world=int(os.environ["WORLD_SIZE"]), ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            )
            if change:
                log.info(f"dspipe: {change}")
        if os.environ.get("RANK", "0") == "0" and not attempt:  # the first step waits for a compile: say so, once
            from dspipe.runtime.ops import notice

            building = notice(offload=run.plan.offload)
            if building:
                log.info(f"dspipe: {building}")
        train(
            run,
            resume=args.resume or "auto",
            restart=args.restart,
            faults=faults,
            hang_timeout=args.hang_timeout,
            attempt=attempt,
            resized=change,
        )
    except (SpecError, RunHalted) as e:
        if elastic_restart(os.environ) is not None:
            _let_rank0_speak_first()
        log.error(f"dspipe: error: {e}")  # every rank hits the same error: rank 0 says it once
        if isinstance(e, SpecError) and elastic_restart(os.environ) is not None and os.environ.get("RANK") == "0":
            record_refusal(args.run, env=os.environ, error=str(e))
        return e.exit_code
    return 0


REFUSAL_GRACE_S = 5.0
"""Under torch's elastic agent, how long a rank other than 0 waits before it leaves on an error every rank hits."""


def _let_rank0_speak_first() -> None:
    """The agent ends every rank as soon as one exits: a rank other than 0 waits a moment, so that rank 0 (which
    alone says the error and records the refusal) is not ended first by a faster rank's exit."""
    if os.environ.get("RANK", "0") != "0":
        time.sleep(REFUSAL_GRACE_S)


def run_rank() -> None:
    exit_rank(main())


if __name__ == "__main__":
    run_rank()
