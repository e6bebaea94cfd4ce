//go:build !crashtest

package attack

// buildTags builds the CLI under test without crash points, as this test
// binary was built.
const buildTags = ""
