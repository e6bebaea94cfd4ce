#!/bin/sh
# The node's only address lives on a dummy interface: kubelet and the
# apiserver need a routable address and a default route, nothing leaves the VM.
modprobe overlay
modprobe br_netfilter
sysctl -qw net.ipv4.ip_forward=1 net.bridge.bridge-nf-call-iptables=1 net.bridge.bridge-nf-call-ip6tables=1
ip link show dummy0 >/dev/null 2>&1 || ip link add dummy0 type dummy
ip addr replace 192.168.77.10/24 dev dummy0
ip link set dummy0 up
ip link set lo up
ip route replace default via 192.168.77.1 dev dummy0 onlink
exit 0
