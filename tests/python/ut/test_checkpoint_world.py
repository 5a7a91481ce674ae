"""hyper_parallel.checkpoint in a program that made torch.distributed's world and nothing of this
library's: saving joins that world itself, as the layers do."""

import os
import subprocess
import sys
import textwrap


def test_save_joins_the_world_torch_distributed_made(tmp_path):
    root = str(tmp_path / "ckpt")
    script = textwrap.dedent(f"""
        import os, socket
        import torch.distributed as dist
        from torch import nn
        from hyper_parallel import checkpoint
        held = socket.socket()
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", 0))
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(held.getsockname()[1]))
        dist.init_process_group("gloo")
        held.close()
        checkpoint.save({root!r}, 1, nn.Linear(2, 2))
        checkpoint.load({root!r}, nn.Linear(2, 2))
        print("saved and loaded step", checkpoint.latest_step({root!r}))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "saved and loaded step 1" in done.stdout
