// Package k8sname checks names and label values by Kubernetes' rules, in
// Kubernetes' words: the answers of k8s.io/apimachinery's
// api/validate/content, without the regular expressions that package
// compiles at every start of every process that links it (docs/design.md,
// "Two binaries"). Its tests hold the two to the same answers.
package k8sname

import "fmt"

const (
	// SubdomainMaxLength is the longest DNS-1123 subdomain, in bytes.
	SubdomainMaxLength = 253
	// LabelValueMaxLength is the longest label value, in bytes.
	LabelValueMaxLength = 63
)

const (
	subdomainMsg  = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
	labelValueMsg = "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)

// Subdomain returns why value is not a lowercase RFC 1123 subdomain (what
// Kubernetes asks of object names and of node names); nil if it is one.
func Subdomain(value string) []string {
	return check(value, SubdomainMaxLength, isSubdomain, subdomainMsg)
}

// LabelValue returns why value is not a Kubernetes label value; nil if it
// is one (the empty string is).
func LabelValue(value string) []string {
	return check(value, LabelValueMaxLength, isLabelValue, labelValueMsg)
}

// check is Kubernetes' pair of answers: the length first, then the form.
func check(value string, maxLength int, ok func(string) bool, msg string) []string {
	var errs []string
	if len(value) > maxLength {
		errs = append(errs, maxLen(maxLength))
	}
	if !ok(value) {
		errs = append(errs, msg)
	}
	return errs
}

func maxLen(n int) string { return fmt.Sprintf("must be no more than %d bytes", n) }

// isSubdomain: dot-separated labels, each of lowercase letters, digits
// and '-', starting and ending with a letter or digit.
func isSubdomain(s string) bool {
	start := 0
	for i := 0; i <= len(s); i++ {
		if i < len(s) && s[i] != '.' {
			if !lowerAlnum(s[i]) && s[i] != '-' {
				return false
			}
			continue
		}
		if i == start || !lowerAlnum(s[start]) || !lowerAlnum(s[i-1]) {
			return false
		}
		start = i + 1
	}
	return true
}

// isLabelValue: empty, or letters, digits, '-', '_' and '.', starting and
// ending with a letter or digit.
func isLabelValue(s string) bool {
	if s == "" {
		return true
	}
	for i := 0; i < len(s); i++ {
		if !alnum(s[i]) && s[i] != '-' && s[i] != '_' && s[i] != '.' {
			return false
		}
	}
	return alnum(s[0]) && alnum(s[len(s)-1])
}

func lowerAlnum(c byte) bool { return 'a' <= c && c <= 'z' || '0' <= c && c <= '9' }

func alnum(c byte) bool { return lowerAlnum(c) || 'A' <= c && c <= 'Z' }
