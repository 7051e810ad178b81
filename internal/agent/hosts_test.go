package agent

import "testing"

func TestNamesHost(t *testing.T) {
	for _, tc := range []struct {
		hosts string
		want  bool
	}{
		{"127.0.0.1 localhost\n127.0.1.1 sb-1\n", true},
		{"127.0.0.1\tlocalhost sb-1 # both\n", true},
		{"127.0.0.1 localhost\n", false},
		{"sb-1 127.0.0.1\n", false},            // an address, not a name
		{"# 127.0.1.1 sb-1\n", false},          // commented out
		{"127.0.0.1 localhost #sb-1\n", false}, // in a comment
		{"127.0.1.1 sb-10\n", false},
		{"", false},
	} {
		if got := namesHost([]byte(tc.hosts), "sb-1"); got != tc.want {
			t.Errorf("namesHost(%q) = %v, want %v", tc.hosts, got, tc.want)
		}
	}
}
