#!/bin/bash
# Runs one step: step.sh NAME OUTDIR. Loads the shared library, the suite's
# own (/e2e/suite/lib.sh, if any) and the suite's step bodies, then runs
# step_NAME (dashes become underscores).
STEP=$1
OUT=$2
. /e2e/lib/lib.sh
[ -f /e2e/suite/lib.sh ] && . /e2e/suite/lib.sh
. /e2e/suite/steps.sh
fn="step_${STEP//-/_}"
if ! declare -F "$fn" >/dev/null; then
	die "unknown step $STEP"
fi
"$fn"
