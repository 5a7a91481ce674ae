"""Shared fixtures of the Python tests. Unit tests run in one process (a world of one rank,
made here); system tests run under hp-run (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set),
every rank running the same tests in the same order."""

import os
import socket

import pytest
import torch
import torch.distributed as dist


def _held_port() -> socket.socket:
    """A free port, kept bound on every local address (as the store binds it; with SO_REUSEADDR,
    not listening) until the store listens on it beside this socket: released at once, another
    program could take it meanwhile."""
    try:
        s = socket.socket(socket.AF_INET6)
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        host = "::"
    except OSError:  # no IPv6 on this machine
        s, host = socket.socket(), ""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    return s


@pytest.fixture(scope="session", autouse=True)
def process_group():
    """torch.distributed's world over Gloo: hp-run's, or a single rank of our own."""
    if "WORLD_SIZE" not in os.environ:
        with _held_port() as held:
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(held.getsockname()[1]))
            dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    yield
    import hyper_parallel._C as C

    dist.barrier()
    if C.is_initialized():
        C.destroy_process_group()
    dist.destroy_process_group()


def world_size() -> int:
    return dist.get_world_size()


def rank() -> int:
    return dist.get_rank()
