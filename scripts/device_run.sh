#!/usr/bin/env bash
# One call on the GPU machine (the `device` tool): build the extension for the torch found
# there, then run the stages asked for, leaving full logs and JSON under $OUT.
#
#   usage: bash scripts/device_run.sh [STAGE...]    (default: build floors tests overhead bench)
#          bash scripts/device_run.sh --help        (every stage, one line each)
#   OUT defaults to ./device_out. Stages run in the order of the job files below, whatever the
#   order asked. Each job file in scripts/device/ documents its stages, one `# stage` line each.
#   On a machine with several GPUs every stage but multi-gpu runs on GPU 0 alone. Test stages
#   append each failure's text to $OUT/test_failures.log as it happens (printed at the end), so
#   a stage cut off by its time bound still says why.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=scripts/device
JOBS="build floors tests bench ab probes multi_gpu examples"
KNOWN=$(sed -n 's/^# stage \([a-z0-9-]*\):.*/\1/p' $(printf "$DEVICE/%s.sh " $JOBS) | tr '\n' ' ')
if [[ " $* " == *" --help "* || " $* " == *" -h "* ]]; then
  sed -n 's/^# stage /  /p' $(printf "$DEVICE/%s.sh " $JOBS)
  exit 0
fi
STAGES=${*:-build floors tests overhead bench}
for s in $STAGES; do
  [[ " $KNOWN " == *" $s "* ]] || { echo "unknown stage: $s (stages: $KNOWN)"; exit 2; }
done

source "$DEVICE/common.sh"
machine_record
source "$DEVICE/build.sh"
mps_start
for job in $JOBS; do
  [[ $job == build ]] || source "$DEVICE/$job.sh"
done
finish
exit $status
