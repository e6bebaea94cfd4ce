package attack

import "testing"

// /dev/sparsevol/<uuid> is node-wide: a UUID another store already links
// is refused at create (exit 2), and a second store's volume with that
// UUID neither takes the link over (attach, exit 1) nor removes it.
func TestUUIDLinkedByAnotherStore(t *testing.T) {
	t.Run("create", func(t *testing.T) {
		t.Parallel()
		c := newCase(t)
		a, b := c.store("a"), c.store("b")
		u := c.create(a, "v")
		c.attach(a, u)
		before := c.snapshot()
		c.expectCode(c.sv(b, "create", "w", "--no-start", "--size", "16M", "--uuid", u), 2)
		c.unchanged(before)
	})
	t.Run("attach and detach", func(t *testing.T) {
		t.Parallel()
		c := newCase(t)
		a, b := c.store("a"), c.store("b")
		u := c.create(a, "v")
		c.create(b, "w", "--uuid", u)
		c.attach(a, u)
		before := c.snapshot()
		c.expectCode(c.sv(b, "attach", "w"), 1)
		c.unchanged(before)
		c.expectCode(c.sv(b, "detach", "w"), 0, 1)
		c.unchanged(before)
	})
}
