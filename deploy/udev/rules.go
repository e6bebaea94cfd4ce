// Package udevrules is sparsevol's udev rule, 59-sparsevol.rules: the file
// the node package installs (make install) and, embedded, the rule the
// CSI plugin installs in udev's runtime rules directory on a node where
// no package did.
package udevrules

import _ "embed"

// RuleName is the rule's file name: it sorts before
// 60-persistent-storage.rules, which probes unless the rule says
// otherwise.
const RuleName = "59-sparsevol.rules"

// Rule is the content of RuleName. Callers do not modify it.
//
//go:embed 59-sparsevol.rules
var Rule []byte
