// Package systemdunit embeds the template unit shipped in this directory, so
// the binary can install exactly the file the repository tests.
package systemdunit

import _ "embed"

// Template is sparsevol@.service.
//
//go:embed sparsevol@.service
var Template string
