package k8sname

import (
	"slices"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/api/validate/content"
)

// cases lie on each side of every rule; the fuzz target starts from them.
var cases = []string{
	"", "a", "A", "0", "-", ".", "_", "a.b", "a..b", ".a", "a.", "a-b", "-a", "a-",
	"a_b", "a.-b", "a-.b", "example.com", "Example.com", "my-name.v1", "node-1",
	"MyValue", "my_value", "12345", "a b", "a/b", "é", "aé", "a\n", "\na", "a\x00",
	strings.Repeat("a", 63), strings.Repeat("a", 64), strings.Repeat("a", 253),
	strings.Repeat("a", 254), strings.Repeat("-", 254),
	strings.Repeat("a.", 126) + "a", strings.Repeat("a.", 127),
}

func TestSameAsKubernetes(t *testing.T) {
	for _, s := range cases {
		same(t, s)
	}
}

func FuzzSameAsKubernetes(f *testing.F) {
	for _, s := range cases {
		f.Add(s)
	}
	f.Fuzz(same)
}

func same(t *testing.T, s string) {
	t.Helper()
	if got, want := Subdomain(s), content.IsDNS1123Subdomain(s); !slices.Equal(got, want) {
		t.Errorf("Subdomain(%q) = %q, Kubernetes says %q", s, got, want)
	}
	if got, want := LabelValue(s), content.IsLabelValue(s); !slices.Equal(got, want) {
		t.Errorf("LabelValue(%q) = %q, Kubernetes says %q", s, got, want)
	}
}
