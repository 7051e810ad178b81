package session

import "testing"

// A run's command goes to its shell in a group whose stdin is /dev/null
// (the marker line after it is not the command's to read).
func TestShellLine(t *testing.T) {
	for in, want := range map[string]string{
		"read x":             "{ read x\n} </dev/null\n",
		"echo a # comment\n": "{ echo a # comment\n} </dev/null\n",
		"cat <<EOF\nx\nEOF":  "{ cat <<EOF\nx\nEOF\n} </dev/null\n",
		"  \n":               "\n",
	} {
		if got := shellLine(in); got != want {
			t.Errorf("shellLine(%q) = %q, want %q", in, got, want)
		}
	}
}
