#!/usr/bin/env bash
# Stop the single-node SLURM cluster started by .ci/slurm_up.sh: slurmd, slurmctld, munged, each
# by the pid in its pid file (never by name). Safe to run when nothing is running.
# SLURM_DOWN_CLEAN=1 also removes the saved state (/var/spool/slurm) for a clean next start.
set -uo pipefail
SPOOL=${SLURM_SPOOL:-/var/spool/slurm}

stop() {  # stop <name> <pidfile>: TERM, wait up to 10 s, then KILL
  local pid
  [ -s "$2" ] || return 0
  pid=$(cat "$2")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
    echo "slurm_down: stopped $1 ($pid)"
  fi
  rm -f "$2"
}

stop slurmd "$SPOOL/slurmd.pid"
stop slurmctld "$SPOOL/slurmctld.pid"
stop munged /run/munge/munged.pid
if [ -n "${SLURM_DOWN_CLEAN:-}" ]; then
  rm -rf "${SPOOL:?}/ctld" "${SPOOL:?}/d" "$SPOOL"/*.log
  echo "slurm_down: removed state under $SPOOL"
fi
exit 0
