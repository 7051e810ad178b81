//go:build !client

package main

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// TestDeployFiles checks deploy/: every Kubernetes manifest parses, every
// shoal container runs the image the Dockerfile makes with flags `shoal
// serve` accepts, exposes the ports it listens on, and reaches etcd at the
// etcd Service; the Services point at ports the pods name; the systemd
// units' command lines parse; the Dockerfile installs the binaries where
// serve finds them and the runtime packages scripts/deps.sh installs.
func TestDeployFiles(t *testing.T) {
	const image = "shoal:dev"
	files, err := filepath.Glob("../../deploy/kubernetes/*.yaml")
	if err != nil || len(files) < 3 {
		t.Fatalf("manifests: %v %v", files, err)
	}
	type port struct {
		Name          string `json:"name"`
		ContainerPort int    `json:"containerPort"`
	}
	type container struct {
		Name    string   `json:"name"`
		Image   string   `json:"image"`
		Command []string `json:"command"`
		Args    []string `json:"args"`
		Ports   []port   `json:"ports"`
		Env     []struct {
			Name string `json:"name"`
		} `json:"env"`
	}
	type object struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
		Metadata   struct {
			Name string `json:"name"`
		} `json:"metadata"`
		Spec struct {
			Selector json.RawMessage `json:"selector"`
			Ports    []struct {
				Name       string `json:"name"`
				Port       int    `json:"port"`
				TargetPort any    `json:"targetPort"`
			} `json:"ports"`
			Template struct {
				Metadata struct {
					Labels map[string]string `json:"labels"`
				} `json:"metadata"`
				Spec struct {
					InitContainers []container `json:"initContainers"`
					Containers     []container `json:"containers"`
				} `json:"spec"`
			} `json:"template"`
		} `json:"spec"`
	}
	var objs []object
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for i, doc := range strings.Split(string(b), "\n---\n") {
			var o object
			if err := yaml.Unmarshal([]byte(doc), &o); err != nil {
				t.Fatalf("%s document %d: %v", filepath.Base(f), i, err)
			}
			if o.APIVersion == "" || o.Kind == "" || o.Metadata.Name == "" {
				t.Fatalf("%s document %d: no apiVersion, kind or name", filepath.Base(f), i)
			}
			objs = append(objs, o)
		}
	}
	etcdURL := ""
	podPorts := map[string][]port{} // app label → its containers' ports
	roles := map[string]bool{}
	for _, o := range objs {
		if o.Kind == "Service" && o.Metadata.Name == "shoal-etcd" {
			etcdURL = fmt.Sprintf("http://%s:%d", o.Metadata.Name, o.Spec.Ports[0].Port)
		}
	}
	if etcdURL == "" {
		t.Fatal("no shoal-etcd Service")
	}
	varRef := regexp.MustCompile(`\$\(([A-Z_]+)\)`)
	for _, o := range objs {
		pod := o.Spec.Template.Spec
		app := o.Spec.Template.Metadata.Labels["app"]
		for _, c := range append(slices.Clone(pod.InitContainers), pod.Containers...) {
			podPorts[app] = append(podPorts[app], c.Ports...)
			if !strings.HasPrefix(c.Image, "shoal") {
				continue
			}
			if c.Image != image {
				t.Errorf("%s/%s: image %s, want %s (the Dockerfile's)", o.Metadata.Name, c.Name, c.Image, image)
			}
			if len(c.Command) < 2 || c.Command[0] != "/usr/local/bin/shoal" || c.Command[1] != "serve" {
				continue // an init container
			}
			// $(VAR) is Kubernetes' expansion of the container's env.
			args := make([]string, len(c.Args))
			for i, a := range c.Args {
				args[i] = varRef.ReplaceAllStringFunc(a, func(m string) string {
					name := varRef.FindStringSubmatch(m)[1]
					if !slices.ContainsFunc(c.Env, func(e struct {
						Name string `json:"name"`
					}) bool {
						return e.Name == name
					}) {
						t.Errorf("%s/%s: %s is not in its env", o.Metadata.Name, c.Name, m)
					}
					if name == "POD_IP" {
						return "10.1.2.3"
					}
					return "x" + strings.ToLower(name)
				})
			}
			cmd := serveCmd()
			if err := cmd.ParseFlags(args); err != nil {
				t.Errorf("%s/%s: shoal serve %s: %v", o.Metadata.Name, c.Name, strings.Join(c.Args, " "), err)
				continue
			}
			fl := cmd.Flags()
			role, _ := fl.GetString("role")
			roles[role] = true
			if etcd, _ := fl.GetString("etcd"); etcd != etcdURL {
				t.Errorf("%s/%s: --etcd %q, want the etcd Service %s", o.Metadata.Name, c.Name, etcd, etcdURL)
			}
			for _, flag := range []string{"listen", "e2b-listen"} {
				addr, _ := fl.GetString(flag)
				if addr == "" {
					continue
				}
				_, p, err := net.SplitHostPort(addr)
				if err != nil {
					t.Errorf("%s/%s: --%s %q: %v", o.Metadata.Name, c.Name, flag, addr, err)
					continue
				}
				if !slices.ContainsFunc(c.Ports, func(cp port) bool { return fmt.Sprint(cp.ContainerPort) == p }) {
					t.Errorf("%s/%s: listens on %s (--%s) but declares ports %v", o.Metadata.Name, c.Name, p, flag, c.Ports)
				}
				advFlag := map[string]string{"listen": "advertise", "e2b-listen": "e2b-advertise"}[flag]
				if fl.Changed(advFlag) {
					adv, _ := fl.GetString(advFlag)
					if !strings.HasSuffix(adv, ":"+p) {
						t.Errorf("%s/%s: --%s %s is not the port it listens on (%s)", o.Metadata.Name, c.Name, advFlag, adv, p)
					}
				} else if role, _ := fl.GetString("role"); role == "node" && strings.HasPrefix(addr, "0.0.0.0:") {
					t.Errorf("%s/%s: a node listening on every address (--%s %s) must give --%s", o.Metadata.Name, c.Name, flag, addr, advFlag)
				}
			}
		}
	}
	if !roles["control"] || !roles["node"] {
		t.Errorf("roles run: %v, want control and node", roles)
	}
	for _, o := range objs {
		if o.Kind != "Service" {
			continue
		}
		var sel struct {
			App string `json:"app"`
		}
		json.Unmarshal(o.Spec.Selector, &sel)
		for _, sp := range o.Spec.Ports {
			if !slices.ContainsFunc(podPorts[sel.App], func(cp port) bool {
				return cp.Name == fmt.Sprint(sp.TargetPort) || fmt.Sprint(cp.ContainerPort) == fmt.Sprint(sp.TargetPort)
			}) {
				t.Errorf("Service %s: targetPort %v is no port of the pods of app %s (%v)", o.Metadata.Name, sp.TargetPort, sel.App, podPorts[sel.App])
			}
		}
	}

	// systemd units: their command lines parse, ${VAR} filled in.
	units, _ := filepath.Glob("../../deploy/systemd/*.service")
	if len(units) < 2 {
		t.Fatalf("systemd units: %v", units)
	}
	envRef := regexp.MustCompile(`\$\{[A-Z_]+\}`)
	for _, u := range units {
		b, err := os.ReadFile(u)
		if err != nil {
			t.Fatal(err)
		}
		text := strings.ReplaceAll(string(b), "\\\n", " ")
		var exec string
		for _, l := range strings.Split(text, "\n") {
			if v, ok := strings.CutPrefix(l, "ExecStart="); ok {
				exec = v
			}
		}
		f := strings.Fields(envRef.ReplaceAllString(exec, "http://127.0.0.1:2379"))
		if len(f) < 2 || f[0] != "/usr/local/bin/shoal" || f[1] != "serve" {
			t.Errorf("%s: ExecStart %q", filepath.Base(u), exec)
			continue
		}
		if err := serveCmd().ParseFlags(f[2:]); err != nil {
			t.Errorf("%s: shoal serve: %v", filepath.Base(u), err)
		}
	}

	// The Dockerfile: the binaries where serve looks, the runtime packages.
	df, err := os.ReadFile("../../deploy/Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"COPY bin/shoal bin/shoal-server /usr/local/bin/", "COPY bin/shoal-agent /usr/local/lib/shoal/shoal-agent"} {
		if !strings.Contains(string(df), want) {
			t.Errorf("Dockerfile lacks %q", want)
		}
	}
	deps, err := os.ReadFile("../../scripts/deps.sh")
	if err != nil {
		t.Fatal(err)
	}
	for _, pkg := range []string{"runc", "erofs-utils", "e2fsprogs", "ca-certificates", "zstd", "lz4", "iproute2", "qemu-system-x86"} {
		if !regexp.MustCompile(`\b` + regexp.QuoteMeta(pkg) + `\b`).Match(deps) {
			t.Errorf("%s is not in scripts/deps.sh any more: update this list and the Dockerfile", pkg)
		}
		if !regexp.MustCompile(`\b` + regexp.QuoteMeta(pkg) + `\b`).Match(df) {
			t.Errorf("the Dockerfile does not install %s, which a node runs", pkg)
		}
	}
}
