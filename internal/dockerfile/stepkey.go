package dockerfile

import (
	"crypto/sha256"
	"encoding/hex"
)

// StepKey is the cache key of a build step: a hash of its parent's key
// (or, for a FROM, of the digests of the layers it names), the step's
// text with its variables expanded, and the digests of the context files
// it reads (COPY, ADD), in order.
func StepKey(parent, step string, inputs ...string) string {
	h := sha256.New()
	for _, s := range append([]string{parent, step}, inputs...) {
		// Length-prefixed: no two lists of strings hash alike.
		h.Write([]byte{byte(len(s) >> 24), byte(len(s) >> 16), byte(len(s) >> 8), byte(len(s))})
		h.Write([]byte(s))
	}
	return hex.EncodeToString(h.Sum(nil))
}
