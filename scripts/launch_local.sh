#!/usr/bin/env bash
# Start NPROC jaxpar processes on this host, talking over loopback (jax.distributed + gloo on CPU).
# Each process owns (mesh size / NPROC) emulated devices; only process 0 writes metrics and logs.
#
#   scripts/launch_local.sh 2 --config llama_tiny.py --workdir runs/two_procs
#
# PYTHON (default: python) picks the interpreter; JAXPAR_PORT the coordinator port (default: one the OS
# says is free now; a random number could fall on a port another run or the kernel's ephemeral range holds).
set -euo pipefail
nproc=${1:?usage: scripts/launch_local.sh NPROC ARGS...}
shift
python=${PYTHON:-python}
port=${JAXPAR_PORT:-$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
pids=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null || true' TERM INT
for ((i = 0; i < nproc; i++)); do
  "$python" -m jaxpar.train "$@" --coordinator_address "127.0.0.1:$port" --num_processes "$nproc" \
    --process_id "$i" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=$?
done
exit "$status"
