package attack

import "testing"

// ControllerExpandVolume refuses negative sizes with InvalidArgument.
func TestControllerExpandNegative(t *testing.T) { expandNegative(t, false) }
