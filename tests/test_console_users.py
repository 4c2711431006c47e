"""The console's Users page over HTTP: admin only (pages and actions), CSRF, and the API's rules."""

from __future__ import annotations

from scheduler_grpc.auth import Role
from scheduler_grpc.console.security import csrf_token
from scheduler_grpc.console.users import ROUTES
from tests.test_console import Console, _with_cookie, console  # noqa: F401 - `console` is a fixture

PASSWORD = "correct-horse-battery"


async def test_only_admins_reach_the_users_page_or_its_actions(console: Console) -> None:  # noqa: F811
    target = await console.server.api.control.users.create_user("target", PASSWORD, Role.VIEWER)
    actions = [route.path.replace("{id}", target.id) for route in ROUTES if route.method == "POST"]
    assert len(actions) == 6  # create, role, disable, enable, password, delete
    for role in (Role.VIEWER, Role.OPERATOR):
        token = await console.session_for(f"not-admin-{role.value}", role)
        async with console.client() as http:
            _with_cookie(http, token)
            async with http.get("/users") as page:
                assert page.status == 403, role
            async with http.get("/") as page:
                assert 'href="/users"' not in await page.text()
            for action in actions:
                form = {"csrf": csrf_token(token), "role": "admin", "username": "x", "password": PASSWORD,
                        "new_password": PASSWORD}  # fmt: skip
                async with http.post(action, data=form, allow_redirects=False) as reply:
                    assert reply.status == 403, (role, action)
                    assert f"you are {role.value}" in await reply.text()
    unchanged = await console.server.api.control.users.get_user(target.id)
    assert (unchanged.role, unchanged.disabled, unchanged.version) == ("viewer", False, target.version)


async def test_an_admin_manages_users_with_csrf_and_the_apis_rules(console: Console) -> None:  # noqa: F811
    users = console.server.api.control.users
    token = await console.session_for("root", Role.ADMIN)
    async with console.client() as http:
        _with_cookie(http, token)
        csrf = csrf_token(token)
        async with http.post("/users", data={"username": "ana", "password": PASSWORD, "role": "operator"}) as reply:
            assert reply.status == 403  # no CSRF token
        form = {"csrf": csrf, "username": "ana", "password": PASSWORD, "role": "operator"}
        async with http.post("/users", data=form, allow_redirects=False) as reply:
            assert reply.status == 303
            assert reply.headers["Location"].startswith("/users?done=created+ana+")
        async with http.post("/users", data=form) as reply:
            assert reply.status == 409
            body = await reply.text()
            assert "already exists" in body
            assert PASSWORD not in body  # the password is never sent back
        async with http.post("/users", data={**form, "username": "bad name"}) as reply:
            assert reply.status == 400
            assert 'id="u-username-error"' in await reply.text()
        ana = next(user for user in (await users.list_users()).users if user.username == "ana")
        anas_session = await console.session_for("ana", Role.OPERATOR)
        async with http.post(f"/users/{ana.id}/role", data={"csrf": csrf, "role": "viewer"}) as reply:
            assert reply.status == 200
            assert "ana is now viewer" in await reply.text()
        assert (await console.server.api.auth.authenticate(anas_session)).role is Role.VIEWER
        async with http.post(f"/users/{ana.id}/password", data={"csrf": csrf, "new_password": "short"}) as reply:
            assert reply.status == 400
            assert "at least 12 characters" in await reply.text()
        async with http.post(f"/users/{ana.id}/delete", data={"csrf": csrf}) as reply:
            assert "deleted ana" in await reply.text()
        async with http.post("/users/not-a-uuid/disable", data={"csrf": csrf}) as reply:
            assert reply.status == 400
