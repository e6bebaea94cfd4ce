#!/bin/sh
# sparsevol: after install and upgrade. Debian calls it postinst with
# "configure [old-version]", RPM %post with the number of sparsevol
# packages installed once it is done (1 install, 2 upgrade). Both cases
# do the same: make a running systemd load the packaged units. Nothing is
# enabled, started, restarted or disabled: volume instances
# (sparsevol@<uuid>) are enabled by `sparsevol create` and stay as they are;
# restarting one would detach its volume.
set -e

if [ -d /run/systemd/system ]; then
	systemctl daemon-reload || true
fi

# Units written by `make install` or `sparsevol units install` override the
# packaged ones (/etc comes first in systemd's search path) and may run
# another binary.
# A link to /dev/null is the administrator's mask (systemctl mask), not
# units of another binary: it is theirs, and is neither read nor removed.
override=/etc/systemd/system/sparsevol@.service
if [ -L "$override" ] && [ "$(readlink "$override")" = /dev/null ]; then
	echo "sparsevol: $override is masked: no volume is attached at boot until \`systemctl unmask sparsevol@.service\`" >&2
elif [ -e "$override" ] && ! grep -q '^ExecStart=/usr/bin/sparsevol ' "$override"; then
	echo "sparsevol: $override overrides the packaged units and runs another binary;" >&2
	if [ -L "$override" ]; then
		# `systemctl link`'s, which `units uninstall` leaves alone.
		echo "sparsevol: it is a link: remove it (rm $override) to use the packaged units (enabled volumes stay enabled)" >&2
	else
		echo "sparsevol: remove it with \`sparsevol units uninstall\` (enabled volumes stay enabled)" >&2
	fi
fi
exit 0
