// Package testskips tests scripts/testskips.py, which scripts/test runs
// go test's -json output and pytest's skip lines through: the usual go
// test output, every skip with its reason, and a failure on a skip that is
// not on test/skips-allowed.
package testskips

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

const script = "../../scripts/testskips.py"

func python(t *testing.T) string {
	t.Helper()
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Fatalf("scripts/test needs python3: %v", err)
	}
	return py
}

func TestGoTestSkipsAndSummary(t *testing.T) {
	py := python(t)
	skips := filepath.Join(t.TempDir(), "skips")
	gotest := exec.Command("go", "test", "-count=1", "-json", ".")
	gotest.Dir = "testdata/fixture"
	gotest.Env = append(os.Environ(), "GOFLAGS=", "GOTOOLCHAIN=local", "GOWORK=off")
	filter := exec.Command(py, script, "gotest", skips)
	var err error
	if filter.Stdin, err = gotest.StdoutPipe(); err != nil {
		t.Fatal(err)
	}
	if err := gotest.Start(); err != nil {
		t.Fatal(err)
	}
	out, ferr := filter.Output()
	gotest.Wait()
	printed := string(out)
	t.Logf("printed:\n%s", printed)
	if ee, ok := ferr.(*exec.ExitError); !ok || ee.ExitCode() != 1 {
		t.Errorf("filter exit: %v, want 1 (a test failed)", ferr)
	}
	for _, want := range []string{"--- FAIL: TestFails", "this one fails", "FAIL\tfixture"} {
		if !strings.Contains(printed, want) {
			t.Errorf("output lacks %q", want)
		}
	}
	for _, not := range []string{"not printed", "=== RUN", "--- PASS", "--- SKIP"} {
		if strings.Contains(printed, not) {
			t.Errorf("output has %q: go test's non-verbose output would not", not)
		}
	}
	data, err := os.ReadFile(skips)
	if err != nil {
		t.Fatal(err)
	}
	got := strings.Split(strings.TrimSpace(string(data)), "\n")
	want := []string{
		"fixture TestSkipsAllowed: a measurement: set SHOAL_MEASURE=1",
		"fixture TestSkipsNotAllowed: needs a tool this host lacks",
		"fixture TestSub/skips: every create finished within its time: nothing to check",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("skips:\n%s\nwant:\n%s", data, strings.Join(want, "\n"))
	}

	// A pytest skip line too, then the summary against the tree's list.
	pylog := filepath.Join(t.TempDir(), "pytest.log")
	os.WriteFile(pylog, []byte("SKIPPED [2] sdk/python/tests/test_sandbox.py:96: backend fullvm: not in the VM subset (SHOAL_SDK_VM_ALL=1 runs it)\n"), 0o644)
	if out, err := exec.Command(py, script, "pytest", pylog, skips).CombinedOutput(); err != nil {
		t.Fatalf("pytest: %v: %s", err, out)
	}
	summary := func() (string, int) {
		out, err := exec.Command(py, script, "summary", skips, "../skips-allowed").CombinedOutput()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		return string(out), code
	}
	out2, code := summary()
	t.Logf("summary:\n%s", out2)
	if code != 1 || !strings.Contains(out2, "NOT ALLOWED needs a tool this host lacks") || !strings.Contains(out2, "== 1 skips not on the allowed list") {
		t.Errorf("summary exit %d; want 1, naming the skip that is not allowed", code)
	}
	for _, want := range []string{"a measurement: set SHOAL_MEASURE=1", "fixture TestSub/skips", "sdk/python/tests/test_sandbox.py:96 (2 tests)"} {
		if !strings.Contains(out2, want) {
			t.Errorf("summary lacks %q", want)
		}
	}
	// Without the skip that is not allowed, it passes.
	var kept []string
	for _, l := range strings.Split(strings.TrimSpace(string(mustRead(t, skips))), "\n") {
		if !strings.Contains(l, "needs a tool") {
			kept = append(kept, l)
		}
	}
	os.WriteFile(skips, []byte(strings.Join(kept, "\n")+"\n"), 0o644)
	if out, code := summary(); code != 0 {
		t.Errorf("summary of allowed skips: exit %d\n%s", code, out)
	}
}

func mustRead(t *testing.T, p string) []byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
