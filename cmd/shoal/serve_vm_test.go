//go:build !client

package main

import (
	"log/slog"
	"strings"
	"testing"
)

// --vm-layers takes auto, pmem or blk; anything else stops serve.
func TestVMLayersFlag(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	for _, mode := range []string{"auto", "pmem", "blk"} {
		if _, err := vmBackends(vmConfig{MicroVM: "off", FullVM: "off", Layers: mode}, t.TempDir(), "", "", nil, log); err != nil {
			t.Errorf("--vm-layers %s: %v", mode, err)
		}
	}
	if _, err := vmBackends(vmConfig{MicroVM: "off", FullVM: "off", Layers: "dax"}, t.TempDir(), "", "", nil, log); err == nil || !strings.Contains(err.Error(), "--vm-layers") {
		t.Errorf("--vm-layers dax: %v", err)
	}
}
