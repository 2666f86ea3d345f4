"""A loopback RTSP server for the video tests (gst-rtsp-server), run by Debian's /usr/bin/python3,
which has GStreamer's gi bindings (the test venv does not).

    /usr/bin/python3 tests/video/rtsp_server.py --port 8554 --file clip.mkv [--codec h264|h265]

Serves the file (Matroska, H.264 or H.265, not re-encoded) at rtsp://127.0.0.1:PORT/cam, in real
time, one pipeline per client (each client starts at the file's beginning), over TCP or UDP as the
client asks. Prints "ready" once it listens. Stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import signal
import sys

import gi

gi.require_version("Gst", "1.0")
gi.require_version("GstRtspServer", "1.0")
from gi.repository import GLib, Gst, GstRtspServer  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--file", required=True)
    parser.add_argument("--codec", choices=["h264", "h265"], default="h264")
    args = parser.parse_args()
    Gst.init(None)
    server = GstRtspServer.RTSPServer()
    server.set_address("127.0.0.1")
    server.set_service(str(args.port))
    factory = GstRtspServer.RTSPMediaFactory()
    location = args.file.replace('"', "")
    factory.set_launch(
        f'( filesrc location="{location}" ! matroskademux ! {args.codec}parse config-interval=-1 '
        f"! rtp{args.codec}pay name=pay0 pt=96 )"
    )
    factory.set_shared(False)
    server.get_mount_points().add_factory("/cam", factory)
    if server.attach(None) == 0:
        print(f"cannot listen on 127.0.0.1:{args.port}", file=sys.stderr)
        return 1
    loop = GLib.MainLoop()
    GLib.unix_signal_add(GLib.PRIORITY_DEFAULT, signal.SIGTERM, loop.quit)
    GLib.unix_signal_add(GLib.PRIORITY_DEFAULT, signal.SIGINT, loop.quit)
    print("ready", flush=True)
    loop.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
