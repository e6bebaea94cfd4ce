#!/bin/bash
# Runs one step: step.sh NAME OUTDIR. Loads the helpers and the step bodies.
STEP=$1
OUT=$2
. /e2e/guest/lib.sh
. /e2e/guest/steps.sh
fn="step_${STEP//-/_}"
if ! declare -F "$fn" >/dev/null; then
	echo "unknown step $STEP" >&2
	exit 3
fi
"$fn"
