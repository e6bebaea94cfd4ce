// Package systemdunit embeds the units shipped in this directory, so the
// binary can install exactly the files the repository tests.
package systemdunit

import _ "embed"

// Template is sparsevol@.service.
//
//go:embed sparsevol@.service
var Template string

// Boot is sparsevol-boot.service.
//
//go:embed sparsevol-boot.service
var Boot string

// BootDone is sparsevol-boot-done.service.
//
//go:embed sparsevol-boot-done.service
var BootDone string
