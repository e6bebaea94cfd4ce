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
# No kube-proxy on this node: the one Service pods use, the apiserver's
# (kubernetes.default, 10.96.0.1:443: the sidecars' in-cluster config),
# as kube-proxy would route it.
rule="-d 10.96.0.1/32 -p tcp --dport 443 -j DNAT --to-destination 192.168.77.10:6443"
iptables -t nat -C PREROUTING $rule 2>/dev/null || iptables -t nat -A PREROUTING $rule
iptables -t nat -C OUTPUT $rule 2>/dev/null || iptables -t nat -A OUTPUT $rule
exit 0
