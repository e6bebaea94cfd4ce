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
# another binary. The packaged binary says so, and what to do: it reads
# the template as the rest of sparsevol does (a mask is the administrator's
# and left unread; a link is followed only to a regular file of a unit's
# size, so a link to a FIFO or a disk cannot hang or read through this
# script), and names what `sparsevol units uninstall` would remove.
/usr/bin/sparsevol units check-override --binary /usr/bin/sparsevol || true
exit 0
