//go:build crashtest

package attack

// buildTags builds the CLI under test with the crash points this test
// binary was built with (make test passes -tags crashtest).
const buildTags = "crashtest"
