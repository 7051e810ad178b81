package fncall

import (
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"time"
)

// Language says how to build and run one language: the environment its
// sandboxes are made of (a saved environment, or a base and toolkits) and
// command templates. Templates are argv lists (no shell); these elements
// expand:
//
//	{source}   the source file name (Source)
//	{options}  the call's compile options, as separate arguments (or none)
//	{args}     the call's program arguments, as separate arguments (or none)
//
// Commands run in the call's box (the working directory), with Env over a
// minimal environment (PATH, HOME=box, TMPDIR=/tmp, LANG=C.UTF-8).
type Language struct {
	Name string `json:"name"`
	// Template names a saved environment (`shoal env`); exclusive with
	// Base and Toolkits.
	Template string   `json:"template,omitempty"`
	Base     string   `json:"base,omitempty"`
	Toolkits []string `json:"toolkits,omitempty"`
	// Source is the file the call's source code is written to.
	Source  string            `json:"source"`
	Compile []string          `json:"compile,omitempty"` // empty: interpreted
	Run     []string          `json:"run"`
	Env     map[string]string `json:"env,omitempty"`
	// CompileLimits bound the compile step (zero fields: DefaultCompileLimits).
	CompileLimits LimitsConfig `json:"compile_limits,omitzero"`
	// Warm is run once in each new sandbox of the language's pool, to
	// bring the toolchain's files into the caches (optional).
	Warm []string `json:"warm,omitempty"`
}

// LimitsConfig is Limits as written in a configuration file.
type LimitsConfig struct {
	CPUTime   Duration `json:"cpu_time,omitzero"`
	WallTime  Duration `json:"wall_time,omitzero"`
	Memory    int64    `json:"memory,omitempty"`
	Output    int64    `json:"output,omitempty"`
	Processes int      `json:"processes,omitempty"`
}

func (l LimitsConfig) limits() Limits {
	return Limits{CPUTime: time.Duration(l.CPUTime), WallTime: time.Duration(l.WallTime), Memory: l.Memory, Output: l.Output, Processes: l.Processes}
}

// Duration is a time.Duration written as "2s" in JSON.
type Duration time.Duration

func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(time.Duration(d).String()) }

func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("duration: want a string like \"2s\": %w", err)
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return err
	}
	*d = Duration(v)
	return nil
}

// Default layer references of the built-in languages: the base and
// toolkit layers that scripts/up builds from Debian 12's packages.
const (
	DefaultBase      = "debian:12"
	DefaultGCC       = "gcc:12"
	DefaultGoToolkit = "golang:1.19"
)

// DefaultLanguages are python, bash, c, cpp and go on Debian 12's
// toolchains (python3.11, bash 5.2, gcc/g++ 12, go 1.19).
func DefaultLanguages() []Language {
	goEnv := map[string]string{
		"GOCACHE": "/box/.cache/go-build", "GOPATH": "/box/.go", "CGO_ENABLED": "0",
		"GOPROXY": "off", "GO111MODULE": "auto",
	}
	return []Language{
		{
			Name: "python", Base: DefaultBase, Source: "main.py",
			Run:  []string{"python3", "main.py", "{args}"},
			Env:  map[string]string{"PYTHONDONTWRITEBYTECODE": "1"},
			Warm: []string{"python3", "-c", "import sys, os, re, math, collections"},
		},
		{
			Name: "bash", Base: DefaultBase, Source: "main.sh",
			Run:  []string{"bash", "main.sh", "{args}"},
			Warm: []string{"bash", "-c", ":"},
		},
		{
			Name: "c", Base: DefaultBase, Toolkits: []string{DefaultGCC}, Source: "main.c",
			Compile: []string{"gcc", "-O2", "-std=gnu17", "-o", "main", "main.c", "{options}", "-lm"},
			Run:     []string{"./main", "{args}"},
			Warm:    []string{"sh", "-c", "printf '#include <stdio.h>\\n#include <stdlib.h>\\n#include <string.h>\\n#include <math.h>\\nint main(void){return 0;}\\n' > /tmp/w.c && gcc -O2 -o /tmp/w /tmp/w.c -lm"},
		},
		{
			Name: "cpp", Base: DefaultBase, Toolkits: []string{DefaultGCC}, Source: "main.cpp",
			Compile: []string{"g++", "-O2", "-std=gnu++17", "-o", "main", "main.cpp", "{options}"},
			Run:     []string{"./main", "{args}"},
			Warm:    []string{"sh", "-c", "printf '#include <iostream>\\n#include <vector>\\n#include <string>\\n#include <algorithm>\\nint main(){std::cout<<1;}\\n' > /tmp/w.cpp && g++ -O2 -o /tmp/w /tmp/w.cpp"},
		},
		{
			Name: "go", Base: DefaultBase, Toolkits: []string{DefaultGoToolkit}, Source: "main.go",
			Compile: []string{"go", "build", "-o", "main", "{options}", "main.go"},
			Run:     []string{"./main", "{args}"},
			Env:     goEnv,
			Warm:    []string{"go", "version"},
			// The go command runs the compiler and linker as processes
			// with many threads each.
			CompileLimits: LimitsConfig{Processes: 512},
		},
	}
}

var langName = regexp.MustCompile(`^[a-z0-9][a-z0-9_+.-]{0,31}$`)

// validate checks a language definition.
func (l *Language) validate() error {
	if !langName.MatchString(l.Name) {
		return fmt.Errorf("language %q: a name is 1-32 of [a-z0-9_+.-], starting with a letter or digit", l.Name)
	}
	if l.Template != "" && (l.Base != "" || len(l.Toolkits) > 0) {
		return fmt.Errorf("language %s: template and base/toolkits are exclusive", l.Name)
	}
	if l.Template == "" && l.Base == "" {
		return fmt.Errorf("language %s: needs a template or a base layer", l.Name)
	}
	if !validBoxPath(l.Source) {
		return fmt.Errorf("language %s: source %q must be a relative file name", l.Name, l.Source)
	}
	if len(l.Run) == 0 || l.Run[0] == "" || strings.HasPrefix(l.Run[0], "{") {
		return fmt.Errorf("language %s: run command is empty", l.Name)
	}
	if len(l.Compile) > 0 && (l.Compile[0] == "" || strings.HasPrefix(l.Compile[0], "{")) {
		return fmt.Errorf("language %s: compile command must start with a program", l.Name)
	}
	for k := range l.Env {
		if k == "" || strings.ContainsAny(k, "=\x00") {
			return fmt.Errorf("language %s: bad environment variable name %q", l.Name, k)
		}
	}
	return nil
}

// stackKey identifies the environment of a language before resolution.
func (l *Language) stackKey() string {
	if l.Template != "" {
		return "template:" + l.Template
	}
	return "base:" + l.Base + " toolkits:" + strings.Join(l.Toolkits, ",")
}

// expand returns the template with its placeholders expanded.
func expand(tmpl []string, source string, options, args []string) []string {
	out := make([]string, 0, len(tmpl)+len(options)+len(args))
	for _, a := range tmpl {
		switch a {
		case "{options}":
			out = append(out, options...)
		case "{args}":
			out = append(out, args...)
		default:
			out = append(out, strings.ReplaceAll(a, "{source}", source))
		}
	}
	return out
}

// ConfigFile is the JSON form of Config (`shoal serve` reads it from the
// file named by $SHOAL_FNCALL_CONFIG). Languages of the same name as a
// default replace it; with "replace_defaults" the defaults are dropped.
type ConfigFile struct {
	MaxConcurrent   int          `json:"max_concurrent,omitempty"`
	Warm            int          `json:"warm,omitempty"`
	MinIdle         int          `json:"min_idle,omitempty"`
	IdleTimeout     Duration     `json:"idle_timeout,omitzero"`
	MaxUses         int          `json:"max_uses,omitempty"`
	Isolation       string       `json:"isolation,omitempty"` // "cgroup" or "sandbox"
	UID             int          `json:"uid,omitempty"`
	GID             int          `json:"gid,omitempty"`
	Box             string       `json:"box,omitempty"`
	CgroupParent    string       `json:"cgroup_parent,omitempty"`
	SandboxMemory   int64        `json:"sandbox_memory,omitempty"`
	DefaultLimits   LimitsConfig `json:"default_limits,omitzero"`
	MaxLimits       LimitsConfig `json:"max_limits,omitzero"`
	CompileLimits   LimitsConfig `json:"compile_limits,omitzero"`
	ReplaceDefaults bool         `json:"replace_defaults,omitempty"`
	Languages       []Language   `json:"languages,omitempty"`
}

// LoadConfig reads a ConfigFile.
func LoadConfig(path string) (Config, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return Config{}, fmt.Errorf("fncall config: %w", err)
	}
	var f ConfigFile
	dec := json.NewDecoder(strings.NewReader(string(b)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&f); err != nil {
		return Config{}, fmt.Errorf("fncall config %s: %w", path, err)
	}
	cfg := Config{
		MaxConcurrent: f.MaxConcurrent, Warm: f.Warm, MinIdle: f.MinIdle, IdleTimeout: time.Duration(f.IdleTimeout),
		MaxUses: f.MaxUses, UID: f.UID, GID: f.GID, Box: f.Box, CgroupParent: f.CgroupParent,
		SandboxMemory: f.SandboxMemory, DefaultLimits: f.DefaultLimits.limits(), MaxLimits: f.MaxLimits.limits(),
		CompileLimits: f.CompileLimits.limits(),
	}
	switch f.Isolation {
	case "", "cgroup":
	case "sandbox":
		cfg.Isolation = IsolationSandbox
	default:
		return Config{}, fmt.Errorf("fncall config %s: isolation %q: want \"cgroup\" or \"sandbox\"", path, f.Isolation)
	}
	cfg.Languages = DefaultLanguages()
	if f.ReplaceDefaults {
		cfg.Languages = nil
	}
	for _, l := range f.Languages {
		if i := slices.IndexFunc(cfg.Languages, func(d Language) bool { return d.Name == l.Name }); i >= 0 {
			cfg.Languages[i] = l
		} else {
			cfg.Languages = append(cfg.Languages, l)
		}
	}
	if cfg.Languages == nil {
		cfg.Languages = []Language{}
	}
	return cfg, nil
}
