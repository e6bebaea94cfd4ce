#!/bin/sh
# Waits (bounded) until the apiserver answers /readyz, so controllers do not
# crash-loop on TLS handshake timeouts while it starts.
for i in $(seq 1 300); do
	kubectl --kubeconfig=/etc/kubernetes/admin.kubeconfig get --raw /readyz >/dev/null 2>&1 && exit 0
	sleep 1
done
exit 0
