# Sourced by the setup and check scripts (not run on its own).
#
# apt_install PKG...: install Debian packages quietly (apt-get update, then
# install), through sudo when not root; prints what it installs. The callers
# decide what is missing, so a machine that has everything never touches apt.
apt_install() {
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "== installing $* (apt-get)"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}
