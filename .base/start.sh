#!/usr/bin/env bash
# Start the qwen35 OpenAI-compatible server in the background, or stop it.
#
#   ./start.sh --port 8000 [--model DIR|HUB_ID|PRESET] [--tp N] [--host H] [--log FILE] [--timeout S]
#              [--api-key-file FILE] [any other qwen35.serve / engine flag, passed through]
#   ./start.sh --stop --port 8000
#
# Starting first checks that the port is free (any listener, HTTP or not, fails the start at once), then runs
# `torchrun --nproc-per-node N -m qwen35.serve ...` detached (setsid nohup), logging to --log (default
# logs/server-<port>.log; an earlier log is kept, renamed LOG.<its last-write time>) and recording its pid in
# logs/server-<port>.pid, then waits until GET /health answers 200 (--timeout seconds, default 1800: loading the real
# model takes minutes). It prints the URL and exits 0 leaving the server running; if the server dies or does not
# become healthy in time it is stopped, the log tail is printed and the exit status is 1 (2 for bad usage).
# API key: QWEN35_API_KEY in the environment or --api-key-file FILE; --api-key KEY works too (it then travels to
# the server in QWEN35_API_KEY, never on its command line or in the log, but this script's own command line shows it).
# Defaults: the model Qwen/Qwen3.5-35B-A3B, tensor parallel over every visible GPU. Without a GPU, pass
# `--model tiny` (a small synthetic checkpoint that runs on the CPU, TP over gloo with --tp N).
# Stopping sends SIGTERM to the ranks (rank 0 ends every request in flight with an error, streams with a final
# error event and [DONE], then shuts the engine down, which ends the worker ranks) and kills whatever is left after
# --stop-wait seconds (default 60). PYTHON=... picks the interpreter (default python3).
set -euo pipefail
DEFAULT_MODEL=Qwen/Qwen3.5-35B-A3B
PORT=8000 MODEL=$DEFAULT_MODEL TP="" HOST=0.0.0.0 LOG="" TIMEOUT=1800 STOP=0 STOP_WAIT=60
PYTHON=${PYTHON:-python3}
PASS=()
while [ $# -gt 0 ]; do
  case "$1" in  # accept --flag=value for our own flags too
    --port=*|--model=*|--tp=*|--tensor-parallel-size=*|--host=*|--log=*|--timeout=*|--stop-wait=*|--api-key=*)
      set -- "${1%%=*}" "${1#*=}" "${@:2}" ;;
  esac
  case "$1" in
    --port) PORT=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --tp|--tensor-parallel-size) TP=$2; shift 2 ;;  # the process count; the engine takes it from torchrun
    --host) HOST=$2; shift 2 ;;
    --log) LOG=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --stop-wait) STOP_WAIT=$2; shift 2 ;;
    --api-key) export QWEN35_API_KEY=$2; shift 2 ;;  # to the server in its environment: not in ps, not logged
    --stop) STOP=1; shift ;;
    -h|--help) sed -n '2,20p' "$0" | cut -c3-; exit 0 ;;
    *) PASS+=("$1"); shift ;;
  esac
done
[[ $PORT =~ ^[0-9]+$ && $TIMEOUT =~ ^[0-9]+$ && $STOP_WAIT =~ ^[0-9]+$ ]] \
  || { echo "start.sh: --port, --timeout and --stop-wait take whole numbers" >&2; exit 2; }
# relative --model and --log paths mean the caller's directory; everything else happens in the repo root
[ -e "$MODEL" ] && MODEL=$(realpath "$MODEL")
[ -n "$LOG" ] && LOG=$(realpath -m "$LOG")
cd "$(dirname "$0")"
ROOT=$PWD
PIDFILE=logs/server-$PORT.pid
LOG=${LOG:-logs/server-$PORT.log}
case "$HOST" in 0.0.0.0|::|"") PROBE=127.0.0.1 ;; *) PROBE=$HOST ;; esac
URL=http://$PROBE:$PORT

alive() {  # a zombie (dead, not yet reaped) does not count
  local s
  s=$(ps -o stat= -p "$1" 2>/dev/null) && [[ $s != Z* ]]
}

descendants() {
  local c
  for c in $(pgrep -P "$1" 2>/dev/null); do echo "$c"; descendants "$c"; done
}

health_code() {  # HTTP status of GET /health, 000 when nothing answers
  curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$URL/health" 2>/dev/null || true
}

stop_server() {
  local pid=$1 procs ranks i
  # torchrun starts each rank in its own session, so the ranks must be found now, while their parent is alive
  ranks=$(descendants "$pid" | tr '\n' ' ')
  procs="$pid $ranks"
  # signal the ranks rather than torchrun: rank 0 shuts the engine down, the workers follow, and torchrun then
  # exits on its own (signalled itself, it would end with a SignalException traceback in the log)
  kill -TERM ${ranks:-$pid} 2>/dev/null || true
  for ((i = 0; i < STOP_WAIT * 2; i++)); do
    local left=""
    for p in $procs; do alive "$p" && left="$left $p"; done
    [ -z "$left" ] && return 0
    sleep 0.5
  done
  echo "start.sh: still running after ${STOP_WAIT}s, killing:$left" >&2
  kill -KILL $left 2>/dev/null || true
}

if [ "$STOP" = 1 ]; then
  if [ ! -f "$PIDFILE" ] || ! alive "$(cat "$PIDFILE")"; then
    echo "start.sh: no server running for port $PORT"
    rm -f "$PIDFILE"
    exit 0
  fi
  stop_server "$(cat "$PIDFILE")"
  rm -f "$PIDFILE"
  echo "start.sh: stopped the server on port $PORT"
  exit 0
fi

# the server binds the same way (before loading the model, too); checked here before the pid file and log change
if ! "$PYTHON" -c '
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((host, port))' "$HOST" "$PORT" 2>/dev/null; then
  echo "start.sh: port $PORT is already in use on $HOST (if it is our server: ./start.sh --stop --port $PORT)" >&2
  exit 1
fi

if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
  GPUS=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c . || true)
elif command -v nvidia-smi >/dev/null; then
  GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
else
  GPUS=0
fi
if [ "$GPUS" = 0 ] && [ "$MODEL" = "$DEFAULT_MODEL" ]; then
  echo "start.sh: no GPU found, and the default model $DEFAULT_MODEL needs GPUs." >&2
  echo "start.sh: on a CPU, serve the tiny synthetic model: ./start.sh --port $PORT --model tiny [--tp 2]" >&2
  exit 2
fi
TP=${TP:-$((GPUS > 0 ? GPUS : 1))}

mkdir -p logs "$(dirname "$LOG")"
if [ -e "$LOG" ]; then  # keep the earlier log: it may hold the traceback of the crash being investigated
  mv --backup=numbered "$LOG" "$LOG.$(date -r "$LOG" +%Y%m%d-%H%M%S)"
fi
# never NVLink multicast (NVLS): on shared hosts it can take the GPUs out of service
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
CMD=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$TP" -m qwen35.serve
     --host "$HOST" --port "$PORT" --model "$MODEL" ${PASS[@]+"${PASS[@]}"})
echo "start.sh: ${CMD[*]}${QWEN35_API_KEY:+ (API key from \$QWEN35_API_KEY, not shown)}" >"$LOG"
setsid nohup "${CMD[@]}" >>"$LOG" 2>&1 </dev/null &
PID=$!
echo "$PID" >"$PIDFILE"
echo "start.sh: starting $MODEL with TP=$TP on port $PORT (pid $PID, log $LOG); waiting up to ${TIMEOUT}s for /health"

fail() {
  echo "start.sh: $1; last lines of $LOG:" >&2
  tail -n 60 "$LOG" >&2
  rm -f "$PIDFILE"
  exit 1
}

START=$SECONDS
while true; do
  if ! alive "$PID"; then
    wait "$PID" && rc=0 || rc=$?
    fail "the server exited (status $rc) before becoming healthy"
  fi
  [ "$(health_code)" = 200 ] && break
  if ((SECONDS - START >= TIMEOUT)); then
    stop_server "$PID"
    fail "no healthy /health after ${TIMEOUT}s; stopped it"
  fi
  sleep 1
done
echo "start.sh: ready after $((SECONDS - START))s: $URL (OpenAI API at $URL/v1)"
echo "start.sh: log $LOG; stop with ./start.sh --stop --port $PORT"
