//go:build !crashtest

package volume

// crashPoint marks a step where the crash-safety tests kill the process
// (crash.go, built with -tags crashtest). The shipped binary has none.
func crashPoint(string) {}
