#!/bin/sh
# sparsevol: after remove and upgrade. Debian calls it postrm with "remove",
# "purge", or "upgrade new-version" (and abort-*/failed-upgrade on errors);
# RPM %postun with the number of sparsevol packages left (0 erase, 1
# upgrade). Neither ever deletes the store (/var/lib/sparsevol), a volume,
# or an instance's enablement: on upgrade the new package carries on with
# them, on remove they wait for the package to come back.
set -e

case "$1" in
remove | purge | 0) removed=yes ;;
*) removed=no ;;
esac

if [ -d /run/systemd/system ]; then
	systemctl daemon-reload || true
fi

if [ "$removed" = yes ]; then
	echo "sparsevol: kept the store /var/lib/sparsevol, its volumes and their enabled units;" >&2
	echo "sparsevol: attached volumes stay attached until shutdown, and come back at boot once sparsevol is installed again" >&2
fi
exit 0
