package e2e

import (
	"encoding/json"
	"testing"
)

// TestDensity runs `shoal bench density` at a small scale through the CLI:
// 50 sandboxes, each with a resident shell, are created, paused (all of
// them), a sample resumed by a first exec, and deleted, with no error; the
// paused ones hold less of their cgroups' memory than running (when the
// host has swap for the pause to reclaim into). The 3,200 run is in the
// README.
func TestDensity(t *testing.T) {
	need(t)
	// Small disks: 50 of the default 1 GiB can exceed the disk budget a
	// host with little free space gives (4x the data dir's free space
	// less a reserve), with the rest of the suite's sandboxes beside them.
	out, stderr, code := run3(nil, "bench", "density", "-n", "50", "-c", "4", "--sample", "20", "--disk", "64M", "--base", baseRef)
	if code != 0 {
		t.Fatalf("bench density exited %d: %s\n%s", code, stderr, out)
	}
	var res struct {
		Created    int    `json:"created"`
		Errors     int    `json:"errors"`
		FirstError string `json:"first_error"`
		Pause      struct {
			N int `json:"n"`
		} `json:"pause"`
		Resume struct {
			N int `json:"n"`
		} `json:"resume_first_exec"`
		Reclaimed  int64   `json:"reclaimed_bytes"`
		DeleteAll  float64 `json:"delete_all_seconds"`
		CreateAll  float64 `json:"create_all_seconds"`
		PerRunning struct {
			MemAvailable int64 `json:"host_memavailable_drop"`
		} `json:"per_sandbox_running"`
	}
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatalf("bench density output: %v\n%s", err, out)
	}
	if res.Created != 50 || res.Errors != 0 {
		t.Fatalf("created %d of 50, %d errors (first: %s)", res.Created, res.Errors, res.FirstError)
	}
	if res.Pause.N != 50 || res.Resume.N != 20 {
		t.Fatalf("paused %d of 50, resumed %d of 20", res.Pause.N, res.Resume.N)
	}
	if res.DeleteAll <= 0 {
		t.Fatal("the sandboxes were not deleted")
	}
	if hostHasSwap() && res.Reclaimed < 50<<20 {
		t.Errorf("pausing 50 sandboxes reclaimed %d bytes, want at least 1 MiB each (their agents' heaps)", res.Reclaimed)
	}
	t.Logf("50 sandboxes: created in %.1f s, MemAvailable %d KiB lower per sandbox running", res.CreateAll, res.PerRunning.MemAvailable>>10)
}
