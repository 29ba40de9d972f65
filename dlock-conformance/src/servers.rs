//! Server faults as operations a case can call: kill, start (with or without
//! data), snapshot, pause, find the leader, isolate a node from its peers.
//!
//! The harness supplies them ([`Harness::servers`](crate::Harness::servers)),
//! so an adapter outside this repository brings its own process control; the
//! suite never looks for scripts of its own. [`ServicesCommand`] drives any
//! supervisor command with the interface it documents, named by the
//! environment variable `DLOCK_SERVICES` ([`ServicesCommand::from_env`]);
//! [`MemoryServers`] controls the in-process memory server.

use std::fmt;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use async_trait::async_trait;
use dlock_core::memory::MemoryBackend;
use dlock_core::url::StoreUrl;

use crate::Failure;

/// The environment variable that names the supervisor command of the test
/// servers (see [`ServicesCommand`]): a path to an executable.
pub const SERVICES_VAR: &str = "DLOCK_SERVICES";

/// Process control of the deployment under test. Nodes are numbered in the
/// harness's endpoint order.
///
/// Cases that call these run alone (no other case of the test binary runs
/// meanwhile), and put every node back as they found it, also on failure.
#[async_trait]
pub trait Servers: Send + Sync + fmt::Debug {
    /// How many nodes.
    fn nodes(&self) -> usize;

    /// Kills node `node` at once (SIGKILL: no clean shutdown). What it had
    /// written to disk stays.
    async fn kill(&self, node: usize) -> Result<(), Failure>;

    /// Starts node `node` from the data on its disk and waits until it
    /// serves (and, in a cluster, has rejoined).
    async fn start(&self, node: usize) -> Result<(), Failure>;

    /// Deletes a killed node's data, so that its next start begins empty;
    /// `None` where the harness cannot.
    async fn wipe(&self, node: usize) -> Option<Result<(), Failure>> {
        let _ = node;
        None
    }

    /// Kills every node.
    async fn kill_all(&self) -> Result<(), Failure> {
        for node in 0..self.nodes() {
            self.kill(node).await?;
        }
        Ok(())
    }

    /// Starts every node (a cluster needs a majority up before any member
    /// serves, so this starts them together).
    async fn start_all(&self) -> Result<(), Failure> {
        for node in 0..self.nodes() {
            self.start(node).await?;
        }
        Ok(())
    }

    /// Writes what node `node` holds now to disk, so that a restart brings
    /// exactly this state back (Redis `SAVE`); `None` where the store keeps
    /// every acknowledged write anyway, or cannot.
    async fn snapshot(&self, node: usize) -> Option<Result<(), Failure>> {
        let _ = node;
        None
    }

    /// Stops node `node` (SIGSTOP): connections stay open, nothing answers.
    async fn pause(&self, node: usize) -> Result<(), Failure>;

    /// Resumes a paused node (SIGCONT).
    async fn resume(&self, node: usize) -> Result<(), Failure>;

    /// The node leading a consensus cluster now; `None` for stores without a
    /// leader.
    async fn leader(&self) -> Option<Result<usize, Failure>> {
        None
    }

    /// Cuts node `node` off from its peers (clients still reach it); `None`
    /// where the harness cannot.
    async fn isolate(&self, node: usize) -> Option<Result<(), Failure>> {
        let _ = node;
        None
    }

    /// Undoes [`isolate`](Self::isolate).
    async fn rejoin(&self, node: usize) -> Result<(), Failure> {
        let _ = node;
        Ok(())
    }

    /// Steps node `node`'s clock forward by `by` (an NTP step); `None` where
    /// the harness cannot.
    async fn step_clock(&self, node: usize, by: Duration) -> Option<Result<(), Failure>> {
        let _ = (node, by);
        None
    }

    /// The client endpoints (`host:port`) of the nodes this controls, in
    /// node order, where it knows them. The server-fault cases compare them
    /// with [`Harness::endpoints`](crate::Harness::endpoints) and skip when
    /// they differ: faults on servers that are not the ones under test
    /// prove nothing.
    async fn endpoints(&self) -> Option<Result<Vec<String>, Failure>> {
        None
    }

    /// What the supervisor knows of these nodes (their state and the last
    /// lines of their logs), for the message of a case that could not reach
    /// them; `None` where it cannot say.
    async fn describe(&self) -> Option<String> {
        None
    }
}

/// [`Servers`] through a supervisor command (the dlock repository's
/// `scripts/services`, or one written alike) with this interface:
///
/// - `CMD kill|up|wipe|snapshot|pause|resume|isolate|rejoin NAME...`: the
///   operation on each node; exit status 3 means "not supported for this
///   server" (`wipe`, `snapshot` and `isolate` may say so);
/// - `CMD leader GROUP`: prints the NAME of the group's leader;
/// - `CMD status NAME...`: one line per node, `NAME STATE URL ...`: the URL
///   its clients use (the suite checks it is the URL under test).
///
/// The suite finds the command in the environment variable `DLOCK_SERVICES`
/// ([`ServicesCommand::from_env`]), never by a path of its own.
///
/// ```no_run
/// use dlock_conformance::servers::ServicesCommand;
/// let servers = ServicesCommand::from_env(["etcd-c1", "etcd-c2", "etcd-c3"])
///     .map(|s| s.group("etcd-cluster"));
/// ```
#[derive(Debug, Clone)]
pub struct ServicesCommand {
    command: PathBuf,
    names: Vec<String>,
    group: Option<String>,
}

/// The exit status meaning "this operation does not apply to this server".
const UNSUPPORTED: i32 = 3;

impl ServicesCommand {
    /// Nodes `names` (in endpoint order), controlled by `command`.
    pub fn new<I, S>(command: impl Into<PathBuf>, names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            command: command.into(),
            names: names.into_iter().map(Into::into).collect(),
            group: None,
        }
    }

    /// Nodes `names` controlled by the command in `DLOCK_SERVICES`; `None`
    /// (and, once per process, a line on stderr saying the server-fault
    /// cases are skipped) when it is unset.
    pub fn from_env<I, S>(names: I) -> Option<Self>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        match std::env::var_os(SERVICES_VAR).filter(|c| !c.is_empty()) {
            Some(command) => Some(Self::new(command, names)),
            None => {
                static NOTE: std::sync::Once = std::sync::Once::new();
                NOTE.call_once(|| {
                    crate::loud(&format!(
                        "NOTE {SERVICES_VAR} is not set: the cases that kill, pause or \
                         restart servers say SKIPPED (set it to a supervisor command, such \
                         as the dlock repository's scripts/services)"
                    ));
                });
                None
            }
        }
    }

    /// The command line that starts every node (`CMD up NAME...`).
    pub fn start_command(&self) -> String {
        format!("{} up {}", self.command.display(), self.names.join(" "))
    }

    /// The cluster's group name, for `leader`.
    pub fn group(mut self, group: impl Into<String>) -> Self {
        self.group = Some(group.into());
        self
    }

    async fn run(&self, args: Vec<String>) -> Result<(i32, String), Failure> {
        let command = self.command.clone();
        let shown = format!("{} {}", command.display(), args.join(" "));
        let out = tokio::task::spawn_blocking(move || run_retrying_busy(&command, &args))
            .await
            .map_err(|e| Failure(format!("{shown}: {e}")))?
            .map_err(|e| Failure(format!("cannot run {shown}: {e}")))?;
        let code = out.status.code().unwrap_or(-1);
        if code != 0 && code != UNSUPPORTED {
            return Err(Failure(format!(
                "{shown} exited with {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok((code, String::from_utf8_lossy(&out.stdout).trim().to_owned()))
    }

    async fn on(&self, verb: &str, node: usize) -> Result<i32, Failure> {
        let name = self
            .names
            .get(node)
            .ok_or_else(|| Failure(format!("no node {node} (of {})", self.names.len())))?;
        Ok(self.run(vec![verb.into(), name.clone()]).await?.0)
    }

    async fn must(&self, verb: &str, node: usize) -> Result<(), Failure> {
        match self.on(verb, node).await? {
            0 => Ok(()),
            _ => Err(Failure(format!(
                "`{verb}` is not supported for {}",
                self.names[node]
            ))),
        }
    }

    async fn maybe(&self, verb: &str, node: usize) -> Option<Result<(), Failure>> {
        match self.on(verb, node).await {
            Ok(0) => Some(Ok(())),
            Ok(_) => None,
            Err(e) => Some(Err(e)),
        }
    }
}

#[async_trait]
impl Servers for ServicesCommand {
    fn nodes(&self) -> usize {
        self.names.len()
    }

    async fn kill(&self, node: usize) -> Result<(), Failure> {
        self.must("kill", node).await
    }

    async fn start(&self, node: usize) -> Result<(), Failure> {
        self.must("up", node).await
    }

    async fn wipe(&self, node: usize) -> Option<Result<(), Failure>> {
        self.maybe("wipe", node).await
    }

    async fn kill_all(&self) -> Result<(), Failure> {
        let mut args = vec!["kill".to_owned()];
        args.extend(self.names.iter().cloned());
        self.run(args).await.map(|_| ())
    }

    async fn start_all(&self) -> Result<(), Failure> {
        let mut args = vec!["up".to_owned()];
        args.extend(self.names.iter().cloned());
        self.run(args).await.map(|_| ())
    }

    async fn snapshot(&self, node: usize) -> Option<Result<(), Failure>> {
        self.maybe("snapshot", node).await
    }

    async fn pause(&self, node: usize) -> Result<(), Failure> {
        self.must("pause", node).await
    }

    async fn resume(&self, node: usize) -> Result<(), Failure> {
        self.must("resume", node).await
    }

    async fn leader(&self) -> Option<Result<usize, Failure>> {
        let group = self.group.clone()?;
        Some(match self.run(vec!["leader".into(), group]).await {
            Ok((0, name)) => {
                self.names.iter().position(|n| *n == name).ok_or_else(|| {
                    Failure(format!("leader {name:?} is not one of {:?}", self.names))
                })
            }
            Ok(_) => Err(Failure("`leader` is not supported".into())),
            Err(e) => Err(e),
        })
    }

    async fn isolate(&self, node: usize) -> Option<Result<(), Failure>> {
        self.maybe("isolate", node).await
    }

    async fn rejoin(&self, node: usize) -> Result<(), Failure> {
        self.must("rejoin", node).await
    }

    async fn endpoints(&self) -> Option<Result<Vec<String>, Failure>> {
        let mut args = vec!["status".to_owned()];
        args.extend(self.names.iter().cloned());
        Some(match self.run(args).await {
            Ok((0, out)) => self
                .names
                .iter()
                .map(|name| status_endpoint(&out, name))
                .collect::<Result<Vec<Vec<String>>, Failure>>()
                .map(|hosts| hosts.concat()),
            Ok(_) => return None,
            Err(e) => Err(e),
        })
    }

    async fn describe(&self) -> Option<String> {
        let command = self.command.clone();
        let names = self.names.clone();
        let said = tokio::task::spawn_blocking(move || {
            let mut said = String::new();
            for verb in ["status", "logs"] {
                let mut args = vec![verb.to_owned()];
                args.extend(names.iter().cloned());
                let out = run_retrying_busy(&command, &args).ok()?;
                said.push_str(&String::from_utf8_lossy(&out.stdout));
                said.push_str(&String::from_utf8_lossy(&out.stderr));
            }
            Some(said)
        })
        .await
        .ok()??;
        Some(redact_urls(said.trim()))
    }
}

/// `text` with the password of every URL in it masked (a supervisor's
/// status lines and server logs may show the test servers' URLs).
fn redact_urls(text: &str) -> String {
    text.split_inclusive(char::is_whitespace)
        .map(|word| {
            if word.contains("://") {
                let end = word.trim_end();
                format!("{}{}", dlock_core::url::redact(end), &word[end.len()..])
            } else {
                word.to_owned()
            }
        })
        .collect()
}

/// The hosts of `name`'s URL in `status` output (`NAME STATE URL ...` lines).
fn status_endpoint(status: &str, name: &str) -> Result<Vec<String>, Failure> {
    let url = status
        .lines()
        .map(|line| line.split_whitespace().collect::<Vec<_>>())
        .find(|fields| fields.first() == Some(&name))
        .and_then(|fields| fields.get(2).copied())
        .ok_or_else(|| Failure(format!("`status {name}` printed no URL for {name}")))?;
    let url = StoreUrl::parse(url).map_err(|e| Failure(format!("`status {name}`: {e}")))?;
    Ok(url.hosts().iter().map(ToString::to_string).collect())
}

/// [`Servers`] for the in-process memory server: one node, whose "disk"
/// keeps the token counter (unless wiped) and nothing else.
#[derive(Debug, Clone)]
pub struct MemoryServers(pub MemoryBackend);

#[async_trait]
impl Servers for MemoryServers {
    fn nodes(&self) -> usize {
        1
    }

    async fn kill(&self, _node: usize) -> Result<(), Failure> {
        self.0.stop();
        Ok(())
    }

    async fn start(&self, _node: usize) -> Result<(), Failure> {
        self.0.start();
        Ok(())
    }

    async fn wipe(&self, _node: usize) -> Option<Result<(), Failure>> {
        self.0.wipe();
        Some(Ok(()))
    }

    async fn pause(&self, _node: usize) -> Result<(), Failure> {
        self.0.pause();
        Ok(())
    }

    async fn resume(&self, _node: usize) -> Result<(), Failure> {
        self.0.resume();
        Ok(())
    }

    async fn step_clock(&self, _node: usize, by: Duration) -> Option<Result<(), Failure>> {
        self.0.clock().step_forward(by);
        Some(Ok(()))
    }
}

/// Runs `command args`, retrying for up to a second while the executable is
/// busy (ETXTBSY): a script written just before (the tests' fake
/// supervisors) stays open for writing in any child another thread forked
/// meanwhile, until that child's `exec` closes it.
fn run_retrying_busy(
    command: &std::path::Path,
    args: &[String],
) -> std::io::Result<std::process::Output> {
    let mut tries = 0;
    loop {
        match Command::new(command).args(args).output() {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && tries < 100 => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            done => return done,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::redact_urls;

    #[test]
    fn described_servers_show_no_password() {
        let said = "mongo down mongodb://dlock:s3cret@127.0.0.1:17017/?x=1\n  | connecting to postgres://u:pw@h/db";
        assert_eq!(
            redact_urls(said),
            "mongo down mongodb://dlock:***@127.0.0.1:17017/?x=1\n  | connecting to postgres://u:***@h/db"
        );
    }
}
