//! Start `sluice serve` on the built-in model on a free loopback port, talk plain HTTP to it,
//! stop it with a signal. Shared by tests/serve_*.rs.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub struct Server {
    child: Child,
    pub addr: String,
    /// What the server wrote on stderr (see `log_text`).
    pub log: Arc<Mutex<String>>,
    /// The reader thread waits in `read` (nothing read is unaccounted for).
    reading: Arc<AtomicBool>,
    /// The reader thread has ended (the pipe is closed).
    done: Arc<AtomicBool>,
    /// The read end of the server's stderr pipe.
    fd: std::os::fd::RawFd,
}

pub fn cache_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("serve-cache")
}

impl Server {
    /// `sluice serve --port 0 ARGS...`; returns once /health answers.
    pub fn start(args: &[&str]) -> Server {
        Server::start_env(args, &[])
    }

    /// `start` with these environment variables set (SLUICE_API_KEY is cleared otherwise).
    pub fn start_env(args: &[&str], envs: &[(&str, &str)]) -> Server {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
        cmd.arg("serve")
            .args(["--port", "0", "-t", "2"])
            .args(args)
            .env("SLUICE_CACHE_DIR", cache_dir())
            .env_remove("SLUICE_API_KEY");
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start sluice serve");
        let mut stderr = child.stderr.take().expect("stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let reading = Arc::new(AtomicBool::new(true));
        let done = Arc::new(AtomicBool::new(false));
        let fd = {
            use std::os::fd::AsRawFd;
            stderr.as_raw_fd()
        };
        let (tx, rx) = std::sync::mpsc::channel();
        {
            let (log, reading, done) = (log.clone(), reading.clone(), done.clone());
            std::thread::spawn(move || {
                let mut buf = [0u8; 8192];
                let mut sent = false;
                loop {
                    reading.store(true, Ordering::SeqCst);
                    let n = match stderr.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    reading.store(false, Ordering::SeqCst);
                    let mut l = log.lock().unwrap();
                    l.push_str(&String::from_utf8_lossy(&buf[..n]));
                    if !sent {
                        if let Some(at) = l.find("listening on http://") {
                            let rest = &l[at + "listening on http://".len()..];
                            if let Some(end) = rest.find('\n') {
                                let _ = tx.send(rest[..end].trim().to_string());
                                sent = true;
                            }
                        }
                    }
                }
                reading.store(true, Ordering::SeqCst);
                done.store(true, Ordering::SeqCst);
                drop(stderr);
            });
        }
        let addr = match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                panic!("server did not start; stderr:\n{}", log.lock().unwrap());
            }
        };
        let s = Server {
            child,
            addr,
            log,
            reading,
            done,
            fd,
        };
        let t = Instant::now();
        loop {
            if let Ok((200, _)) = s.try_request("GET", "/health", None, &[]) {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "no /health; stderr:\n{}",
                s.log.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        s
    }

    pub fn base(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn try_request(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
        headers: &[(&str, &str)],
    ) -> std::io::Result<(u16, String)> {
        let mut s = TcpStream::connect(&self.addr)?;
        s.set_read_timeout(Some(Duration::from_secs(120)))?;
        let body = body.unwrap_or("");
        let mut req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Length: {}\r\n",
            self.addr,
            body.len()
        );
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("\r\n");
        req.push_str(body);
        s.write_all(req.as_bytes())?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        let status = out
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = out
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        Ok((status, body))
    }

    /// POST JSON; (status, parsed body).
    pub fn post(&self, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
        let (st, b) = self
            .try_request(
                "POST",
                path,
                Some(&body.to_string()),
                &[("Content-Type", "application/json")],
            )
            .expect("request");
        (
            st,
            serde_json::from_str(&b).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {b}")),
        )
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        self.try_request("GET", path, None, &[]).expect("request")
    }

    /// SIGTERM, then the exit code (the server must stop by itself).
    pub fn stop(mut self) -> i32 {
        let pid = self.child.id().to_string();
        let ok = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "could not signal the server");
        let t = Instant::now();
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                return st.code().unwrap_or(-1);
            }
            if t.elapsed() > Duration::from_secs(30) {
                let _ = self.child.kill();
                panic!(
                    "server did not stop within 30 s of SIGTERM; stderr:\n{}",
                    self.log.lock().unwrap()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything the server wrote on stderr so far: waits (up to 5 s) until the reader
    /// thread has taken in what the pipe holds, so a line the server wrote before answering
    /// a request is here once the answer is.
    pub fn log_text(&self) -> String {
        let t = Instant::now();
        while !self.done.load(Ordering::SeqCst) {
            let mut pending: libc::c_int = 0;
            // SAFETY: FIONREAD on the pipe's read end (open while the reader thread runs;
            // a closed descriptor only makes the call fail) into a c_int.
            let r = unsafe { libc::ioctl(self.fd, libc::FIONREAD, &mut pending) };
            if r != 0 || (pending == 0 && self.reading.load(Ordering::SeqCst)) {
                break;
            }
            if t.elapsed() > Duration::from_secs(5) {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        self.log.lock().unwrap().clone()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
