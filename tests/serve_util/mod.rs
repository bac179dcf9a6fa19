//! Start `sluice serve` on the built-in model on a free loopback port, talk plain HTTP to it,
//! stop it with a signal. Shared by tests/serve_*.rs.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub struct Server {
    child: Child,
    pub addr: String,
    /// Everything the server wrote on stderr so far.
    pub log: Arc<Mutex<String>>,
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
        let stderr = child.stderr.take().expect("stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        {
            let log = log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    if let Some(at) = line.find("listening on http://") {
                        let _ =
                            tx.send(line[at + "listening on http://".len()..].trim().to_string());
                    }
                    let mut l = log.lock().unwrap();
                    l.push_str(&line);
                    l.push('\n');
                }
            });
        }
        let addr = match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                panic!("server did not start; stderr:\n{}", log.lock().unwrap());
            }
        };
        let s = Server { child, addr, log };
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

    pub fn log_text(&self) -> String {
        self.log.lock().unwrap().clone()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
