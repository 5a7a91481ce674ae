"""Where the time goes between a rank's death and the first step of the restarted attempt.

Runs llama3_train under `hp-run --max-restarts 1` with HP_FAULT_KILL_AT_STEP, stamps every output
line as it arrives, and splits the gap into phases:
    detection   the rank kills itself -> hp-run has stopped the other ranks: "restart 1/1"
    relaunch    -> the new rank 0 begins its rendezvous (--restart-backoff-s 0, process start,
                libtorch load)
    rendezvous  the process group's init, as rank 0 reports it
    build       -> the model is built and sharded
    load        the checkpoint load, as rank 0 reports it
    first step  -> the first step's line (the step's own time included)
    python3 bench/restart_timeline.py build/tools/hp-run/hp-run build/examples/torch/llama3/llama3_train \
        [--nproc 2] [--preset small] [--kill-step 7] [--repeats 3]"""

import argparse
import os
import re
import statistics
import subprocess
import tempfile
import time


def stamped_run(cmd, env):
    """Runs cmd with stdout and stderr merged; returns [(seconds since start, line)]."""
    start = time.monotonic()
    lines = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1) as proc:
        for line in proc.stdout:
            lines.append((time.monotonic() - start, line.rstrip("\n")))
        if proc.wait() != 0:
            raise SystemExit("restart_timeline.py: the job failed:\n" + "\n".join(l for _, l in lines[-30:]))
    return lines


def first(lines, pattern, after=0.0):
    for t, line in lines:
        if t >= after and re.search(pattern, line):
            return t, line
    raise SystemExit(f"restart_timeline.py: expected a line matching {pattern!r}")


def reported_seconds(line):
    return float(re.search(r" in ([0-9.]+) s", line).group(1))


def phases(lines, kill_step):
    t_kill, _ = first(lines, r"HP_FAULT_KILL_AT_STEP=.*kills itself")
    t_restart, _ = first(lines, r"^hp-run: restart 1/1", t_kill)
    t_rdv, rdv_line = first(lines, r"rendezvous of \d+ ranks \(attempt 1\)", t_restart)
    t_loaded, load_line = first(lines, r"resumed from step", t_rdv)
    t_step, _ = first(lines, r"\[rank 0\] step +\d+ \|", t_loaded)
    rendezvous, load = reported_seconds(rdv_line), reported_seconds(load_line)
    return {
        "detection": t_restart - t_kill,
        "relaunch": t_rdv - rendezvous - t_restart,
        "rendezvous": rendezvous,
        "build": t_loaded - load - t_rdv,
        "load": load,
        "first step": t_step - t_loaded,
        "total": t_step - t_kill,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("hp_run")
    p.add_argument("train")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--preset", default="small")
    p.add_argument("--kill-step", type=int, default=7)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    runs = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as ckpt:
            env = dict(os.environ, HP_FAULT_KILL_AT_STEP=f"1:{args.kill_step}", OMP_NUM_THREADS="1")
            cmd = [args.hp_run, "--nproc-per-node", str(args.nproc), "--max-restarts", "1", "--restart-backoff-s",
                   "0", "--", args.train, "--preset", args.preset, "--steps", str(args.kill_step + 1),
                   "--batch-size", "2", "--checkpoint-dir", ckpt, "--checkpoint-every", "2"]
            runs.append(phases(stamped_run(cmd, env), args.kill_step))
    print(f"rank 1 of {args.nproc} killed at step {args.kill_step}, preset {args.preset}, loopback; "
          f"median of {args.repeats} runs (seconds)")
    for name in runs[0]:
        values = [r[name] for r in runs]
        print(f"  {name:<11} {statistics.median(values):7.3f}   (min {min(values):.3f}, max {max(values):.3f})")


if __name__ == "__main__":
    main()
