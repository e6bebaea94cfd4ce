#!/bin/bash
# Runs one step: step.sh NAME OUTDIR. Loads the shared library and the
# suite's own (/e2e/suite/lib.sh, if any), then the step's body the host
# wrote for this boot (/e2e/boot/steps.d/NAME.sh, the function step_main,
# from the step's Script in the suite's Go file) and runs it.
STEP=$1
OUT=$2
. /e2e/lib/lib.sh
[ -f /e2e/suite/lib.sh ] && . /e2e/suite/lib.sh
[ -f "/e2e/boot/steps.d/$STEP.sh" ] || die "no script for step $STEP"
. "/e2e/boot/steps.d/$STEP.sh"
step_main
