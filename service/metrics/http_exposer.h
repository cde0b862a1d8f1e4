// HttpExposer: serves Prometheus' text format at GET /metrics over HTTP (libmicrohttpd).
//
// prometheus-cpp's own exposer runs on civetweb, whose Debian build gives its worker threads a
// fixed 100 KiB stack; glibc carves a process's static TLS out of that (OpenBLAS alone brings
// 60 KiB), and the first scrape of laproxd overflowed it. libmicrohttpd lets the stack size be
// chosen, so the text still comes from prometheus-cpp's serializer, served from here.
#ifndef LAPROX_SERVICE_METRICS_HTTP_EXPOSER_H_
#define LAPROX_SERVICE_METRICS_HTTP_EXPOSER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

struct MHD_Daemon;

namespace laprox::service {

class HttpExposer {
 public:
  // Listens on `address` ("host:port", IPv4 or "[v6]:port"; port 0 picks one) and answers
  // GET /metrics with `body()` (also "/" with a pointer to it). INVALID_ARGUMENT for a malformed
  // address, UNAVAILABLE when it cannot listen there.
  static absl::StatusOr<std::unique_ptr<HttpExposer>> Start(const std::string& address,
                                                            std::function<std::string()> body);
  ~HttpExposer();
  HttpExposer(const HttpExposer&) = delete;
  HttpExposer& operator=(const HttpExposer&) = delete;

  int port() const { return port_; }
  // The page /metrics serves now. Any exception from `body()` (std::bad_alloc) becomes an HTTP
  // 500 with a short static text for that scrape (counted in failures()); the next scrape tries
  // again. At most 16 connections at once (more wait in the listen backlog), each closed after
  // 10 s without progress: a reply holds its body until it is read, so scrapes hold at most 16
  // bodies.
  std::string Render() const { return body_(); }
  int64_t failures() const { return failures_.load(std::memory_order_relaxed); }
  void CountFailure() const { failures_.fetch_add(1, std::memory_order_relaxed); }

 private:
  explicit HttpExposer(std::function<std::string()> body) : body_(std::move(body)) {}

  std::function<std::string()> body_;
  mutable std::atomic<int64_t> failures_{0};
  MHD_Daemon* daemon_ = nullptr;
  int port_ = 0;
};

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_METRICS_HTTP_EXPOSER_H_
