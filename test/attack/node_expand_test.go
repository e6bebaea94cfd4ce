package attack

import "testing"

// NodeExpandVolume refuses negative sizes with InvalidArgument (it said
// Internal).
func TestNodeExpandNegative(t *testing.T) { expandNegative(t, true) }
