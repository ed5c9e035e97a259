//! TEMPORARY stub until the embedded module lands.
#![allow(missing_docs, dead_code)]
use std::path::{Path, PathBuf};
#[derive(Debug, thiserror::Error)]
#[error("stub")]
pub struct EmbeddedError;
pub struct EmbeddedConfig {
    pub data_dir: PathBuf,
    pub port: Option<u16>,
    pub bin_dir: Option<PathBuf>,
    pub settings: Vec<(String, String)>,
}
impl EmbeddedConfig {
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            port: None,
            bin_dir: None,
            settings: vec![],
        }
    }
}
pub struct EmbeddedPostgres;
impl EmbeddedPostgres {
    pub fn start(_c: EmbeddedConfig) -> Result<Self, EmbeddedError> {
        Err(EmbeddedError)
    }
    pub fn url(&self, _d: &str) -> String {
        String::new()
    }
    pub fn port(&self) -> u16 {
        0
    }
    pub fn data_dir(&self) -> &Path {
        Path::new("")
    }
    pub fn stop(&mut self) -> Result<(), EmbeddedError> {
        Ok(())
    }
    pub fn crash(&mut self) -> Result<(), EmbeddedError> {
        Ok(())
    }
    pub fn restart(&mut self) -> Result<(), EmbeddedError> {
        Ok(())
    }
}
