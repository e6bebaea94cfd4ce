# The step library of every suite (sourced by step.sh before the suite's
# own lib.sh and the step's Script).
#
# A step records facts: "key=value" lines in $OUT/$STEP.facts (fact). It
# does not decide pass or fail; the suite's Go checks do, from the facts,
# across steps and boots. When a step cannot observe or do something it
# was asked to, it says so with fail: that records a "fail=message" line
# (a failure the Go side reports with the step's log) and the step goes
# on. die records the same and ends the step (exit 1), for when nothing
# after it could work. The step's exit code only says whether it ran to
# its end.
set -u -o pipefail
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
E2E=/e2e
STATE=$E2E/state # survives reboots and hard resets (host share)
FACTS=$OUT/$STEP.facts
mkdir -p "$STATE"
[ -f "$E2E/boot/env" ] && . "$E2E/boot/env"

up() { cut -d' ' -f1 /proc/uptime; }
log() { echo "[$(up)] $*"; }
fact() {
	printf '%s=%s\n' "$1" "$2" >>"$FACTS"
	log "fact $1=$2" >&2
}
fail() {
	log "FAIL: $*" >&2
	printf 'fail=%s\n' "$(printf '%s' "$*" | tr '\n' ' ')" >>"$FACTS"
}
die() {
	fail "$@"
	exit 1
}
run() {
	echo "+ $*" >&2
	"$@"
}
yesno() { if "$@"; then echo yes; else echo no; fi; }
oneline() { tr '\n' ' ' | sed 's/ *$//'; }

# retry SECONDS CMD...: runs CMD every second until it succeeds, the last
# try with its output.
retry() {
	local limit=$1 i
	shift
	for ((i = 0; i < limit; i++)); do
		"$@" >/dev/null 2>&1 && return 0
		sleep 1
	done
	"$@"
}
