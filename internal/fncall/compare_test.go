package fncall

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestCompare(t *testing.T) {
	for _, c := range []struct {
		mode      Compare
		tol       float64
		got, want string
		ok        bool
		why       string // substring of the explanation
	}{
		{CompareExact, 0, "3\n", "3\n", true, ""},
		{CompareExact, 0, "3", "3\n", false, "byte 2 (line 1)"},
		{CompareExact, 0, "1\n2\n", "1\n3\n", false, "line 2"},
		{CompareWhitespace, 0, " 1  2\n3 \n\n", "1 2 3", true, ""},
		{CompareWhitespace, 0, "1 2", "1 2 3", false, "token 3: expected \"3\", got end of output"},
		{CompareWhitespace, 0, "1 2 3 4", "1 2 3", false, "expected end of output"},
		{CompareWhitespace, 0, "1.0", "1", false, "token 1"},
		{CompareLines, 0, "a b  \r\nc\n\n\n", "a b\nc", true, ""},
		{CompareLines, 0, "a  b\n", "a b\n", false, "line 1"},
		{CompareLines, 0, "a\n", "a\nb\n", false, "line 2: expected \"b\", got end of output"},
		{CompareFloat, 0, "0.3333333 x", "0.33333333 x", true, ""},
		{CompareFloat, 0, "0.334", "0.333", false, "token 1"},
		{CompareFloat, 1e-2, "0.334", "0.333", true, ""},
		{CompareFloat, 1e-6, "1000000.5", "1000000", true, ""}, // relative
		{CompareFloat, 0, "nan", "nan", true, ""},              // equal tokens
		{CompareFloat, 0, "inf", "1e999", true, ""},
		{CompareFloat, 0, "abc", "abd", false, "token 1"},
	} {
		ok, why := compare(c.mode, c.tol, []byte(c.got), []byte(c.want))
		if ok != c.ok || !strings.Contains(why, c.why) {
			t.Errorf("compare(%s, %q, %q) = %v %q, want %v %q", c.mode, c.got, c.want, ok, why, c.ok, c.why)
		}
	}
	// Long tokens are cut in the explanation.
	_, why := compare(CompareExact, 0, []byte(strings.Repeat("a", 1000)), []byte(strings.Repeat("b", 1000)))
	if len(why) > 200 {
		t.Errorf("explanation too long: %d bytes", len(why))
	}
}

func TestExpand(t *testing.T) {
	got := expand([]string{"g++", "-O2", "-o", "main", "{source}", "{options}", "x{source}"}, "main.cpp", []string{"-DX", "-g"}, nil)
	want := []string{"g++", "-O2", "-o", "main", "main.cpp", "-DX", "-g", "xmain.cpp"}
	if !slices.Equal(got, want) {
		t.Errorf("compile: %q", got)
	}
	got = expand([]string{"./main", "{args}"}, "main.c", nil, nil)
	if !slices.Equal(got, []string{"./main"}) {
		t.Errorf("run without args: %q", got)
	}
}

func TestConfigValidate(t *testing.T) {
	var c Config
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if len(c.Languages) != 5 || c.UID != 10001 || c.Box != "/box" || c.DefaultLimits.CPUTime != 2*time.Second {
		t.Fatalf("defaults: %+v", c)
	}
	for _, bad := range []Language{
		{Name: "Bad Name", Base: "b", Source: "m", Run: []string{"x"}},
		{Name: "x", Source: "m", Run: []string{"x"}},                                               // no base
		{Name: "x", Base: "b", Template: "t", Source: "m", Run: []string{"x"}},                     // both
		{Name: "x", Base: "b", Source: "../m", Run: []string{"x"}},                                 // source escapes
		{Name: "x", Base: "b", Source: "m"},                                                        // no run
		{Name: "x", Base: "b", Source: "m", Run: []string{"{args}"}},                               // run starts with a placeholder
		{Name: "x", Base: "b", Source: "m", Run: []string{"x"}, Env: map[string]string{"A=B": ""}}, // env name
	} {
		c := Config{Languages: []Language{bad}}
		if err := c.Validate(); err == nil {
			t.Errorf("language %+v accepted", bad)
		}
	}
	c = Config{Languages: []Language{DefaultLanguages()[0], DefaultLanguages()[0]}}
	if err := c.Validate(); err == nil {
		t.Error("duplicate language accepted")
	}
}

func TestLoadConfig(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "fncall.json")
	os.WriteFile(p, []byte(`{"max_concurrent": 3, "idle_timeout": "5s", "isolation": "sandbox",
		"default_limits": {"cpu_time": "1s", "memory": 1048576},
		"languages": [{"name": "python", "base": "mybase:1", "source": "main.py", "run": ["python3", "main.py"]},
		              {"name": "lua", "base": "mybase:1", "source": "main.lua", "run": ["lua", "main.lua"]}]}`), 0o644)
	c, err := LoadConfig(p)
	if err != nil {
		t.Fatal(err)
	}
	if c.MaxConcurrent != 3 || c.IdleTimeout != 5*time.Second || c.Isolation != IsolationSandbox || c.DefaultLimits.CPUTime != time.Second || c.DefaultLimits.Memory != 1<<20 {
		t.Fatalf("loaded: %+v", c)
	}
	names := map[string]string{}
	for _, l := range c.Languages {
		names[l.Name] = l.Base
	}
	if len(names) != 6 || names["python"] != "mybase:1" || names["lua"] != "mybase:1" || names["cpp"] != DefaultBase {
		t.Fatalf("languages: %v", names)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(p, []byte(`{"replace_defaults": true, "languages": [{"name": "lua", "base": "b", "source": "m.lua", "run": ["lua", "m.lua"]}]}`), 0o644)
	if c, err = LoadConfig(p); err != nil || len(c.Languages) != 1 {
		t.Fatalf("replace_defaults: %v %v", c.Languages, err)
	}
	for _, bad := range []string{`{"isolation": "vm"}`, `{"unknown": 1}`, `{"idle_timeout": 5}`, `not json`} {
		os.WriteFile(p, []byte(bad), 0o644)
		if _, err := LoadConfig(p); err == nil {
			t.Errorf("config %s accepted", bad)
		}
	}
}

func TestLimits(t *testing.T) {
	var c Config
	c.Validate()
	e := &Engine{cfg: c}
	l, err := e.limits(Limits{CPUTime: time.Second}, c.DefaultLimits)
	if err != nil || l.WallTime != 3*time.Second || l.Memory != 256<<20 || l.Processes != 64 || l.Output != 1<<20 {
		t.Fatalf("filled: %+v %v", l, err)
	}
	for _, bad := range []Limits{
		{CPUTime: -1}, {CPUTime: time.Hour}, {Memory: 100 << 30}, {Memory: 1000}, {Processes: 100000}, {Output: 1 << 40},
	} {
		if _, err := e.limits(bad, c.DefaultLimits); err == nil {
			t.Errorf("limits %+v accepted", bad)
		}
	}
}
