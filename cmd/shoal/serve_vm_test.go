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

// --vm-disk-iops and --vm-disk-bps take a count and a size per second (0:
// unbounded); anything else stops serve.
func TestVMDiskIOFlags(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	off := vmConfig{MicroVM: "off", FullVM: "off", Layers: "auto"}
	for _, bps := range []string{"", "0", "256M", "1G"} {
		c := off
		c.DiskBPS, c.DiskIOPS = bps, 4000
		if _, err := vmBackends(c, t.TempDir(), "", "", nil, log); err != nil {
			t.Errorf("--vm-disk-bps %q: %v", bps, err)
		}
	}
	for _, c := range []vmConfig{{DiskBPS: "fast"}, {DiskBPS: "-1M"}, {DiskIOPS: -1}} {
		c.MicroVM, c.FullVM, c.Layers = "off", "off", "auto"
		if _, err := vmBackends(c, t.TempDir(), "", "", nil, log); err == nil || !strings.Contains(err.Error(), "--vm-disk-") {
			t.Errorf("%+v: %v", c, err)
		}
	}
}

// --vm-pause takes snapshot or in-place; anything else stops serve.
func TestVMPauseFlag(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	for _, mode := range []string{"", "snapshot", "in-place"} {
		if _, err := vmBackends(vmConfig{MicroVM: "off", FullVM: "off", Layers: "auto", Pause: mode}, t.TempDir(), "", "", nil, log); err != nil {
			t.Errorf("--vm-pause %q: %v", mode, err)
		}
	}
	if _, err := vmBackends(vmConfig{MicroVM: "off", FullVM: "off", Layers: "auto", Pause: "freeze"}, t.TempDir(), "", "", nil, log); err == nil || !strings.Contains(err.Error(), "--vm-pause") {
		t.Errorf("--vm-pause freeze: %v", err)
	}
}

// --vm-boot takes cold or template, and refuses template with pmem layers.
func TestVMBootFlag(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	for _, mode := range []string{"", "cold", "template"} {
		if _, err := vmBackends(vmConfig{MicroVM: "off", FullVM: "off", Layers: "auto", Boot: mode}, t.TempDir(), "", "", nil, log); err != nil {
			t.Errorf("--vm-boot %q: %v", mode, err)
		}
	}
	for _, c := range []vmConfig{
		{MicroVM: "off", FullVM: "off", Layers: "auto", Boot: "warm"},
		{MicroVM: "off", FullVM: "off", Layers: "pmem", Boot: "template"},
	} {
		if _, err := vmBackends(c, t.TempDir(), "", "", nil, log); err == nil || !strings.Contains(err.Error(), "--vm-boot") {
			t.Errorf("--vm-boot %s --vm-layers %s: %v", c.Boot, c.Layers, err)
		}
	}
}
