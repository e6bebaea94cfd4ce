// Package attack holds the attack suite: each test reproduces a way to make
// sparsevol touch what is not its own or lose data, through the real CLI
// and the CSI plugin's real socket, and asserts the refusal (exit code or
// gRPC code) and that nothing changed: victim checksums, the loop devices
// bound to the case's files, the mount table and the store listing.
//
// The tests need root (loop devices, mkfs, mounts). TestMain re-executes
// the test binary in a private mount namespace, so a regression that mounts
// over a host path cannot reach the host's mount table.
package attack
