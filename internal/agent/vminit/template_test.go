package vminit

import (
	"crypto/rand"
	"os"
	"testing"
)

// The host's seed goes into the kernel's random generator, which is then
// reseeded (both need CAP_SYS_ADMIN: a guest's init has it): the ioctl
// takes the rand_pool_info that reseed builds.
func TestReseed(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (RNDADDENTROPY, RNDRESEEDCRNG)")
	}
	seed := make([]byte, SeedLen)
	rand.Read(seed)
	if err := reseed(seed); err != nil {
		t.Fatal(err)
	}
	if err := reseed(nil); err != nil {
		t.Errorf("no seed: %v", err)
	}
}
