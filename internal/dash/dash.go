// Package dash holds the web dashboard's static assets (HTML, plain
// JavaScript, CSS and the vendored xterm.js), embedded in the shoal binary.
// The server side (login, sessions, the terminal's WebSocket) is in
// internal/control/dash.go; the page talks to the ordinary API with a
// session token.
package dash

import (
	"embed"
	"io/fs"
)

//go:embed assets
var assets embed.FS

// Assets is the dashboard's file tree (index.html at its root).
func Assets() fs.FS {
	sub, err := fs.Sub(assets, "assets")
	if err != nil {
		panic(err) // the embedded tree always has assets/
	}
	return sub
}
