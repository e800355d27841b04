"""Starting and stopping the other tensor-parallel ranks of a worker on this host.

`pdserve prefill -tp 3` is rank 0: it binds its rendezvous port (a free one
unless --tp-master-port names it) and keeps it bound, so nothing else on the
host can take it before rank 0's store listens on it, then starts
ranks 1 and 2 as child processes (`python -P -m pdserve.app.ranks`, a trimmed environment, the config in
the environment, never on the command line where the internal token would
show). Ranks on other hosts are started as their own commands instead
(`--tp-rank`, `--tp-master-addr`, `--tp-master-port`); both paths meet in
the same rendezvous. A child that loses rank 0 exits on its own: its next
collective fails, and Linux kills it when rank 0's process ends.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

from pdserve.api.config import WorkerConfig
from pdserve.api.child_process import child_environment, python_module_command
from pdserve.app.children import die_with_parent, linux_libc
from pdserve.parallel.rendezvous import listen_on

logger = logging.getLogger(__name__)

CONFIG_VARIABLE = "PDSERVE_RANK_CONFIG"
def with_rank(config: WorkerConfig, rank: int, master_port: int, master_addr: str) -> WorkerConfig:
    parallel = config.parallel.model_copy(update={"tp_rank": rank, "tp_master_port": master_port,
                                                  "tp_master_addr": master_addr})
    return config.model_copy(update={"parallel": parallel})


@dataclass
class LocalRanks:
    """Rank 0's side of a worker whose ranks all live on this host."""
    config: WorkerConfig  # rank 0's
    children: list[subprocess.Popen]  # ranks 1..N-1
    rendezvous_fd: int  # listening on config.parallel.tp_master_port; rank 0's store takes it over

    def lost(self) -> Optional[str]:
        """Which rank exited, and how, or None while every one runs (rank 0 stops waiting for them then)."""
        for rank, child in enumerate(self.children, start=1):
            status = child.poll()
            if status is not None:
                return f"rank {rank} (pid {child.pid}) exited with status {status}"
        return None


def bind_rendezvous(port: int) -> socket.socket:
    """A socket listening on 127.0.0.1:`port` (0: a free port). Binding here, before any rank
    starts, closes the window in which a port that was merely found free gets taken."""
    return listen_on("127.0.0.1", port)


def start_local_ranks(config: WorkerConfig) -> LocalRanks:
    """Bind the rendezvous and start ranks 1..N-1 of a worker whose ranks all live on this host."""
    listener = bind_rendezvous(config.parallel.tp_master_port or 0)
    port = int(listener.getsockname()[1])
    children = []
    libc = linux_libc()
    # Linux kills a rank when rank 0's process ends, however it ends (rank 0 killed while the
    # ranks still wait to meet would otherwise leave them waiting).
    set_up = (lambda: die_with_parent(libc, signal.SIGKILL)) if libc is not None else None
    for rank in range(1, config.parallel.tensor_parallel_size):
        environment = child_environment({CONFIG_VARIABLE: with_rank(config, rank, port, "127.0.0.1").model_dump_json()})
        children.append(subprocess.Popen(python_module_command("pdserve.app.ranks"), env=environment,
                                         preexec_fn=set_up))
    logger.info("started tensor-parallel ranks 1-%d (pids %s), rendezvous on 127.0.0.1:%d",
                len(children), [child.pid for child in children], port)
    return LocalRanks(with_rank(config, 0, port, "127.0.0.1"), children, listener.detach())


def stop_local_ranks(children: list[subprocess.Popen], timeout_s: float = 10.0, told_to_stop: bool = True) -> None:
    """Wait for the ranks rank 0 told to stop; end those that do not. Ranks nobody told (the worker
    stopped before its engine was built: only a built engine's close tells them) are ended at once,
    not after `timeout_s`: they hold nothing anyone is served from."""
    for child in children:
        if not told_to_stop:
            logger.info("ending rank pid %d: the worker stopped before its engine was built", child.pid)
            child.kill()
            child.wait()
            continue
        try:
            child.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("rank pid %d did not stop; killing it", child.pid)
            child.kill()
            child.wait()


def main() -> int:
    from pdserve.runner.tensor_parallel import serve_follower  # noqa: PLC0415 - torch only in the child

    config = WorkerConfig.model_validate_json(os.environ[CONFIG_VARIABLE])
    logging.basicConfig(level=getattr(logging, config.server.log_level.upper()),
                        format=f"%(asctime)s %(levelname)s rank{config.parallel.tp_rank} %(name)s: %(message)s",
                        stream=sys.stderr)
    return serve_follower(config)


if __name__ == "__main__":
    sys.exit(main())
